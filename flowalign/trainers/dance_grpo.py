"""DanceGRPO (arXiv 2505.07818): a preset of Flow-GRPO (``docs/methods/dance_grpo.md``).

The loss is Flow-GRPO's clipped surrogate, unchanged (``flow_grpo.ppo_clip_loss``, here without the KL
term); what DanceGRPO changes is around it:

- every rollout of a prompt group starts from the same ``x_T`` (``shared_initial_noise``);
- its SDE (sampler ``"dance"``): ``μ = x + Δ·[v − (η²/2)·∇log p]``, ``τ = η·sqrt(−Δ)``, on every step;
- per rollout batch and epoch, ``⌊timestep_fraction·(T−1)⌋`` of the first T−1 steps drawn at random are
  trained (the authors' scripts never train the step to σ = 0);
- optionally only the best and worst ``best_of / 2`` samples of each group are trained
  (:func:`flowalign.advantages.best_worst_mask`).
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from flowalign.advantages import best_worst_mask
from flowalign.errors import UserError
from flowalign.limits import MAX_COEFFICIENT, MAX_GROUP_SIZE
from flowalign.sampling import Rollout
from flowalign.trainers.base import StepBatch
from flowalign.trainers.flow_grpo import FlowGRPOConfig, FlowGRPOTrainer
from flowalign.trainers.parts.global_plan import ChunkRef


class DanceGRPOConfig(FlowGRPOConfig):
    name: Literal["dance_grpo"] = "dance_grpo"  # type: ignore[assignment]
    sampler: Literal["dance", "flow_grpo", "cps"] = "dance"  # type: ignore[assignment]
    #: η of the DanceGRPO SDE (0.3 FLUX, 0.25 HunyuanVideo in the authors' scripts)
    noise_level: float = Field(0.3, gt=0, le=2)
    clip_range: float = Field(1e-4, gt=0, le=MAX_COEFFICIENT)
    beta: float = Field(0.0, ge=0, le=MAX_COEFFICIENT)
    shared_initial_noise: bool = True
    advantage: str = Field("group", pattern="^(group|global_std|gdpo|win_rate)$")
    #: train ⌊fraction·(T−1)⌋ of the first T−1 steps, drawn at random per rollout batch and epoch (the authors' 0.6)
    timestep_fraction: float = Field(0.6, gt=0, le=1)
    #: train only the best_of/2 best and best_of/2 worst samples of each group by advantage (0: all; the
    #: authors' HunyuanVideo script: 8 of 24)
    best_of: int = Field(0, ge=0, le=MAX_GROUP_SIZE)


class DanceGRPOTrainer(FlowGRPOTrainer):
    Config = DanceGRPOConfig
    tcfg: DanceGRPOConfig

    @classmethod
    def check_config(cls, cfg, tcfg) -> None:
        super().check_config(cfg, tcfg)
        if tcfg.steps_per_chunk:
            raise UserError("trainer.steps_per_chunk: dance_grpo draws its steps by trainer.timestep_fraction "
                            "(a fraction of the T steps); remove steps_per_chunk")
        if int(tcfg.timestep_fraction * (tcfg.num_steps - 1)) < 1:
            raise UserError(f"trainer.timestep_fraction={tcfg.timestep_fraction} trains ⌊fraction·(num_steps−1)⌋ = 0 "
                            f"of trainer.num_steps={tcfg.num_steps} steps; raise either, e.g. num_steps: 16 with 0.6")
        if tcfg.best_of % 2:
            raise UserError(f"trainer.best_of={tcfg.best_of} must be even (half best, half worst samples), e.g. 8")

    def collect(self, step: int) -> StepBatch:
        """The loop's batch; with ``best_of`` the other samples' advantages are zeroed (not trained)."""
        batch = super().collect(step)
        if self.tcfg.best_of:
            keep = best_worst_mask(batch.advantages, batch.groups, self.tcfg.best_of)
            batch.advantages = batch.advantages * keep
            batch.logs["best_of_fraction"] = keep.float().mean().item()
        return batch

    def trained_steps(self, chunk: Rollout) -> list[int]:
        """Every stochastic step is a candidate (the random draw is in :meth:`chosen_steps`)."""
        return chunk.trained_steps()

    def chosen_steps(self, chunk: ChunkRef, epoch: int) -> list[int]:
        """:func:`drawn_steps` of the chunk, drawn as Flow-GRPO's ``steps_per_chunk`` draws them (keyed by the
        chunk's identity and the epoch, so the draw does not depend on the rank layout)."""
        return drawn_steps(chunk.steps, self.tcfg.num_steps, self.tcfg.timestep_fraction,
                           self.keyed_generator(*chunk.key, epoch, 17))


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
