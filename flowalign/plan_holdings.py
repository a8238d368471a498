"""What a training step keeps on the device, phase by phase, for ``flowalign plan``.

The loop's group rollouts (:meth:`flowalign.trainers.base.GroupTrainer.collect`) are held from sampling until
the step's update is done; a trainer with a ``collect`` of its own may hold more while it samples and scores
(Self-OPD's decoded branch candidates, KVPO's anchor streams) and less through the update (Diffusion-DPO keeps
its pairs, not the rollouts they were picked from; KVPO moves its branches to CPU memory). A step's memory is
described here per prompt of the step on one rank, in the units the planner sizes from the model
(:class:`Holding`): what is kept through the update (:attr:`StepHoldings.update`), and the moments of sampling
and scoring (:attr:`StepHoldings.moments`), each counted whole; the planner adds the largest moment's excess
over the update's own peak.

Each trainer states its own, read from its code (:meth:`flowalign.trainers.base.GroupTrainer.step_holdings`,
the loop's default unless overridden: Self-OPD, KVPO, Diffusion-DPO, GARDO, and the Flow-GRPO family, whose
step with a KL also keeps its reference step means, one per step :meth:`FlowGRPOTrainer.reference_steps` counts
as each preset picks its steps); this module holds the vocabulary they state it in and the counts they share.
"""

from __future__ import annotations

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
    peak). ``means``: further float32 latents kept only while the trained tensors are whole (a KL reference's
    step means, computed once a batch; under fsdp every forward is a collective, so the loss computes each one
    when it needs it and none is kept). ``reward_gradient``: whether a differentiable reward's gradient is taken
    through the VAE decoder then, one training chunk at a time (the decoder's forward with grad and its
    backward: their peak). ``kv_caches``: streams whose KV caches are held besides those of whole rollouts (a
    streaming model's, sized by its policy's ``kv_cache_bytes``; 0 for other models)."""

    rollouts: float = 0.0
    latents: float = 0.0
    means: float = 0.0
    conditionings: float = 0.0
    decoded: float = 0.0
    decoding: bool = False
    swapping: bool = False
    encoding: bool = False
    reward_gradient: bool = False
    kv_caches: float = 0.0


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
