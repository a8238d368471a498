"""What a training step keeps on the device, phase by phase, for ``flowalign plan``.

The loop's group rollouts (:meth:`flowalign.trainers.base.GroupTrainer.collect`) are held from sampling until
the step's update is done; a trainer with a ``collect`` of its own may hold more while it samples and scores
(Self-OPD's decoded branch candidates, KVPO's anchor streams) and less through the update (Diffusion-DPO keeps
its pairs, not the rollouts they were picked from; KVPO moves its branches to CPU memory). A step's memory is
described here per prompt of the step on one rank, in the units the planner sizes from the model
(:class:`Holding`): what is kept through the update (:attr:`StepHoldings.update`), and the moments of sampling
and scoring (:attr:`StepHoldings.moments`), each counted whole; the planner adds the largest moment's excess
over the update's own peak.

A trainer states its own by a classmethod ``step_holdings(tcfg) -> StepHoldings``; for those that do not,
the trainers whose ``collect`` differs from the loop's are described here (:data:`DESCRIBED`), read from
their code: each entry names the tensors it counts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Holding:
    """Device memory of a step, per prompt, in units of one sample's parts (:class:`flowalign.plan.Rollout`).

    ``rollouts``: whole rollout samples (their trajectory of ``T + 1`` float32 latents, stored velocities,
    log-probabilities, conditioning and decoded sample); ``latents``: further float32 latents;
    ``conditionings``: further text conditionings of one sample (both CFG branches where the policy encodes
    them); ``decoded``: further decoded samples (float32 pixels). ``decoding``: whether a VAE decode of one
    chunk runs at this moment (its peak, and the live weights kept while another copy is swapped in, as at
    evaluation under the EMA's); ``swapping``: whether passes run under swapped-in weights then, without a
    decode (the live copy alone); ``encoding``: whether the VAE encodes an image then (one at a time: its
    peak)."""

    rollouts: float = 0.0
    latents: float = 0.0
    conditionings: float = 0.0
    decoded: float = 0.0
    decoding: bool = False
    swapping: bool = False
    encoding: bool = False


@dataclass(frozen=True)
class StepHoldings:
    """What one step holds per prompt: ``update``, kept until the update is done; ``moments`` of sampling and
    scoring, each the whole of what is alive then (the update's holdings included where they exist by then);
    ``samples_per_prompt``: rollouts drawn per prompt where it is not ``rollouts_per_step``'s (0: none drawn,
    e.g. offline preference pairs); ``swaps``: whether passes run with another copy of the trained tensors
    swapped in (None: as the weight copies say, :func:`flowalign.trainers.copies.swaps_in`)."""

    update: Holding
    moments: tuple[Holding, ...] = field(default_factory=tuple)
    samples_per_prompt: int | None = None
    swaps: bool | None = None


def loop_holdings(group_size: int) -> StepHoldings:
    """The loop's default step: ``group_size`` rollouts a prompt, held through the update; sampling's peak is
    the decode of one chunk while they are held."""
    return StepHoldings(Holding(rollouts=group_size), (Holding(rollouts=group_size, decoding=True),))


def self_opd_branched_steps(tcfg: Any) -> int:
    """States branched per trunk, as :meth:`SelfOPDTrainer.branched_steps` draws them: ``branch_steps`` of the
    first ``⌊T·max_step_fraction⌋`` steps (at least 1, never the step to σ = 0), fewer where fewer of them
    have positive odds in ``step_weights``."""
    t = tcfg.num_steps
    high = max(1, min(t - 1, int(t * tcfg.max_step_fraction)))
    if not tcfg.step_weights:
        return min(tcfg.branch_steps, high)
    return min(tcfg.branch_steps, sum(1 for w in list(tcfg.step_weights)[:high] if w > 0))


def self_opd(tcfg: Any) -> StepHoldings:
    """Self-OPD (``flowalign/trainers/self_opd.py``): one ODE trunk a prompt, held through the update (its
    velocities kept). At each of the ``n`` branched states, ``K = branches`` candidates are finished and
    decoded on the device; their decoded samples are kept in a list until every one is drawn (the last set
    is decoded while the others are held), then concatenated and scored: ``2·n·K`` decoded samples alive at
    the scoring peak. The branch sets themselves go to CPU memory."""
    candidates = self_opd_branched_steps(tcfg) * tcfg.branches
    trunk = Holding(rollouts=1)
    return StepHoldings(trunk, (Holding(rollouts=1, decoded=candidates, decoding=True),
                                Holding(rollouts=1, decoded=2 * candidates)))


def kvpo(tcfg: Any) -> StepHoldings:
    """KVPO (``flowalign/trainers/kvpo.py``): per prompt, the anchor stream (the deterministic stream with its
    full history: every chunk's ``T + 1`` float32 latents and its conditioning; log-probabilities in CPU memory)
    is held while its ``G`` branches are streamed one at a time and decoded; the branch videos are kept in a
    list, concatenated and scored (``2G`` decoded), and under ``advantage: anchor`` the anchors are decoded and
    scored beside them (one more each). Every branch's window states and prefix go to CPU memory: nothing of
    the step stays on the device through the update. Not counted: the anchor's KV caches, one per chunk, each
    allocated whole (AnyFlow-FAR-Wan2.1-1.3B at 480×832×81 in bf16: 3.9 GB a stream, 8 chunks), which need
    the family to size its cache, and the one branch being streamed at a time with its own caches."""
    anchor = {"latents": tcfg.num_steps + 1, "conditionings": 1}
    anchor_video = 1 if tcfg.advantage == "anchor" else 0
    return StepHoldings(Holding(), (Holding(**anchor, decoded=tcfg.group_size, decoding=True),
                                    Holding(**anchor, decoded=2 * tcfg.group_size + anchor_video)))


def diffusion_dpo(tcfg: Any) -> StepHoldings:
    """Diffusion-DPO (``flowalign/trainers/diffusion_dpo.py``): through the update, at most one pair a prompt,
    its two float32 latents and one conditioning. Offline pairs (``trainer.pairs``) draw no rollout: the two
    images are loaded at the model's size (float32 pixels, a decoded sample's size) and encoded one at a time
    (the VAE encoder's peak for one image). Online pairs are picked from the loop's ``group_size`` rollouts, which
    are held only while sampling and picking: the final latents and conditioning of all of them are
    concatenated there, beside the pair cut from them."""
    pair = Holding(latents=2, conditionings=1)
    if tcfg.pairs:
        return StepHoldings(pair, (Holding(latents=2, conditionings=1, decoded=2, encoding=True),),
                            samples_per_prompt=0)
    g = tcfg.group_size
    return StepHoldings(pair, (Holding(rollouts=g, decoding=True),
                               Holding(rollouts=g, latents=g + 2, conditionings=g + 1)))


def flow_grpo_reference_steps(tcfg: Any) -> int:
    """Steps of each sample whose KL reference mean a Flow-GRPO step stores (``FlowGRPOTrainer.prepare`` and
    ``plan``, unsharded): the trained steps (the SDE steps among the first ``⌊T·timestep_fraction⌋``, at least
    one; an SDE window's ``sde_window`` at most), and of those at most ``steps_per_chunk`` an inner epoch."""
    t = tcfg.num_steps
    limit = max(1, int(tcfg.timestep_fraction * t))
    sde = tcfg.sde_window if tcfg.sde_window else (t if tcfg.sde_last_step else t - 1)
    steps = max(1, min(sde, limit))
    if 0 < tcfg.steps_per_chunk < steps:
        steps = min(steps, tcfg.steps_per_chunk * tcfg.inner_epochs)
    return steps


def gardo(tcfg: Any) -> StepHoldings:
    """GARDO (``flowalign/trainers/gardo.py``): the loop's rollouts, with their final latents concatenated once
    for the diversity features. Its reference snapshot is a copy of the trained tensors held all along (the
    weight copies count it with the EMA's, in every phase). With a KL (``beta > 0``) the reference's step
    means are computed with the snapshot swapped into the live parameters (the live values kept meanwhile)
    while the rewards are scored and before the update (:func:`flow_grpo_reference_steps` float32 latents a
    sample, kept through the update); its refresh after the optimiser steps holds the old and new snapshot at
    once. Both are outside the update, while the gradients are freed. Without a KL none of this happens.
    GARDO refuses fsdp, so the means are always stored."""
    g = tcfg.group_size
    base = loop_holdings(g)
    moments = base.moments + ((Holding(rollouts=g, latents=g),) if tcfg.diversity else ())
    if tcfg.beta <= 0:
        return StepHoldings(base.update, moments, swaps=False)
    means = g * flow_grpo_reference_steps(tcfg)
    held = Holding(rollouts=g, latents=means)
    return StepHoldings(held, (*moments, Holding(rollouts=g, latents=means, swapping=True)), swaps=True)


#: trainer name → its step's holdings, for the trainers whose ``collect`` is not the loop's and which do not
#: state their own (``step_holdings``)
DESCRIBED: dict[str, Callable[[Any], StepHoldings]] = {
    "self_opd": self_opd, "kvpo": kvpo, "diffusion_dpo": diffusion_dpo, "gardo": gardo}


def step_holdings(trainer: type, tcfg: Any) -> StepHoldings:
    """What a step of ``trainer`` with the section ``tcfg`` holds per prompt: the trainer's own statement
    (``step_holdings``), else its entry in :data:`DESCRIBED`, else the loop's default for its
    ``rollouts_per_step``."""
    own = getattr(trainer, "step_holdings", None)
    if callable(own):
        return own(tcfg)
    described = DESCRIBED.get(getattr(tcfg, "name", ""))
    if described is not None:
        return described(tcfg)
    return loop_holdings(trainer.rollouts_per_step(tcfg)[1])
