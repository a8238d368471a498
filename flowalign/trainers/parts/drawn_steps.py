"""DanceGRPO's trained steps: a random fraction of a rollout's first T−1 steps, drawn per sample (or per rollout
batch) and epoch (DanceGRPO, and Pref-GRPO whose scripts are DanceGRPO's)."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import torch
from pydantic import Field

from flowalign.config import Section
from flowalign.errors import UserError
from flowalign.trainers.rollouts import StepBatch


class DrawnStepOptions(Section):
    """How many of the first T−1 steps a rollout batch trains, drawn at random."""

    #: train ⌊fraction·(T−1)⌋ of the first T−1 steps, drawn at random per sample and epoch (the authors' 0.6)
    timestep_fraction: float = Field(0.6, gt=0, le=1)
    #: per_sample: every sample draws its own steps, as the authors' per-sample ``torch.randperm`` (each trained
    #: unit is one sample at one step); per_batch: the samples of a rollout batch share one draw (batched forwards)
    step_draw: Literal["per_sample", "per_batch"] = "per_sample"
    #: counted: a rollout batch (a sample, drawn per sample) whose advantages are all zero is not run (its
    #: gradient is zero) but counts in the size of the optimiser step it falls in, as the authors' loops run it
    #: and count it in their gradient_accumulation_steps × train_timesteps divisor (an optimiser step of such
    #: batches only is taken on a zero gradient, as theirs); skipped: it neither runs nor counts (Flow-GRPO's
    #: filter)
    zero_advantage: Literal["counted", "skipped"] = "counted"


def check_drawn_steps(tcfg: Any) -> None:
    """Refuse a ``timestep_fraction`` that trains no step of ``num_steps``."""
    if int(tcfg.timestep_fraction * (tcfg.num_steps - 1)) < 1:
        raise UserError(f"trainer.timestep_fraction={tcfg.timestep_fraction} trains ⌊fraction·(num_steps−1)⌋ = 0 "
                        f"of trainer.num_steps={tcfg.num_steps} steps; raise either, e.g. num_steps: 16 with 0.6")


def drawn_steps(steps: tuple[int, ...] | list[int], num_steps: int, fraction: float,
                generator: torch.Generator) -> list[int]:
    """The trained steps of one rollout batch: ``⌊fraction·(T−1)⌋`` of its stochastic ``steps`` before the
    last, at random, in step order.

    The authors' scripts (DanceGRPO ``train_grpo_flux.py``, Pref-GRPO ``train_flux.py``) keep the first T−1
    transitions of a rollout (``[:, :-1]``) and train ``int((T−1)·timestep_fraction)`` of them in a random
    order: the step to σ = 0 is sampled, never trained.
    """
    last = num_steps - 1
    candidates = [k for k in steps if k < last]
    n = int(fraction * last)
    if n >= len(candidates):
        return candidates
    pick = torch.randperm(len(candidates), generator=generator)
    return [candidates[j] for j in sorted(pick[:n].tolist())]


def drawn_reference_steps(tcfg: Any) -> int:
    """Steps of each sample whose KL reference mean a step stores when :func:`drawn_steps` picks them: the SDE
    steps before the last (every step, or the ``sde_window``), ``⌊fraction·(T−1)⌋`` of them an inner epoch, all
    of them at most (an upper bound where epochs pick the same). ``tcfg``: a config with
    :class:`DrawnStepOptions`, ``num_steps``, ``sde_window``, ``sde_last_step`` and ``inner_epochs``."""
    t = tcfg.num_steps
    sde = tcfg.sde_window if tcfg.sde_window else (t if tcfg.sde_last_step else t - 1)
    candidates = min(sde, t - 1)
    per_epoch = min(candidates, int(tcfg.timestep_fraction * (t - 1)))
    return min(candidates, per_epoch * tcfg.inner_epochs)


def per_sample_batch(batch: StepBatch) -> StepBatch:
    """``batch`` with every rollout batch split into one-sample chunks, so that each sample draws its own steps
    (:func:`drawn_steps` is keyed by the chunk's identity, here its one sample's (group, member)), as the
    authors train: sample by sample, each at its own ``perms[i]``. The advantages keep their order, and so does
    what ``prepare`` computed: it works on this split too (a one-sample forward rounds differently from the
    sample's in its rollout batch, so means computed per rollout batch would make a run depend on how many of
    them were ready before the rewards). The one-sample chunks are views of the batch's tensors: the split that
    ``prepare`` makes and the one ``collect`` keeps copy nothing."""
    chunks = [chunk.single(j) for chunk in batch.chunks for j in range(len(chunk))]
    return dataclasses.replace(batch, chunks=chunks)
