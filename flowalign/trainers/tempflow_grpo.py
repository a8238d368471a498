"""TempFlow-GRPO (arXiv 2508.04324): Flow-GRPO with trajectory branching and noise-aware weighting
(``docs/methods/tempflow_grpo.md``).

The sampler changes, not the loss (:mod:`flowalign.sampling.branching`): every member of a prompt group
starts from the group's ``x_T`` (a seed group), runs the ODE except at one branching step ``k`` drawn per
group from ``branch_steps``, where it takes the Flow-GRPO SDE step; only ``k`` is trained. The loss is
Flow-GRPO's clipped surrogate with the step's noise-aware weight ``w_k = τ_k / mean_{j∈K} τ_j``:

    r = exp(ℓ_k(θ) − ℓ_k(θ_old))
    L = mean_i w_k·max(−A_i·r, −A_i·clip(r, 1−ε, 1+ε)) + β·KL(μ_θ ‖ μ_ref)
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from flowalign.config import StepIndex
from flowalign.errors import UserError
from flowalign.limits import MAX_COEFFICIENT
from flowalign.sampling import Rollout, StepOutput, branch_candidates, draw_branch_step, noise_aware_weights
from flowalign.trainers.base import Sampling, StepBatch
from flowalign.trainers.flow_grpo import FlowGRPOConfig, FlowGRPOTrainer, ppo_clip_loss


class TempFlowGRPOConfig(FlowGRPOConfig):
    name: Literal["tempflow_grpo"] = "tempflow_grpo"  # type: ignore[assignment]
    #: the noise-aware weight needs a Gaussian step of known std
    sampler: Literal["flow_grpo", "dance"] = "flow_grpo"  # type: ignore[assignment]
    #: the steps a group may branch at (one drawn per group and training step); None: 0 … num_steps − 2
    branch_steps: list[StepIndex] | None = None
    #: each trained step's surrogate weighted by w_k = τ_k / mean over branch_steps of τ
    noise_weighting: bool = True
    #: a seed group: every member of a prompt group starts from the same x_T
    shared_initial_noise: bool = True
    advantage: str = Field("group", pattern="^(group|global_std|gdpo|win_rate)$")
    beta: float = Field(0.0, ge=0, le=MAX_COEFFICIENT)


def weighted_clip_loss(log_prob: torch.Tensor, old_log_prob: torch.Tensor, adv: torch.Tensor, clip_range: float,
                       step_weight: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample ``w_k·max(−A·r, −A·clip(r, 1−ε, 1+ε))`` ``(B,)`` with ``r = exp(ℓ − ℓ_old)``, the ratio
    and the clipped flag (``step_weight`` = ``w_k``, or 1)."""
    per_sample, ratio, clipped = ppo_clip_loss(log_prob, old_log_prob, adv, clip_range)
    return step_weight * per_sample, ratio, clipped


class TempFlowGRPOTrainer(FlowGRPOTrainer):
    Config = TempFlowGRPOConfig
    tcfg: TempFlowGRPOConfig

    @classmethod
    def check_config(cls, cfg, tcfg) -> None:
        super().check_config(cfg, tcfg)
        if tcfg.sde_window or tcfg.steps_per_chunk:
            raise UserError("trainer.sde_window / trainer.steps_per_chunk: tempflow_grpo trains its branching "
                            "step alone (trainer.branch_steps); remove them")
        try:
            branch_candidates(tcfg.num_steps, tcfg.branch_steps)
        except ValueError as e:
            raise UserError(f"trainer.branch_steps: {e}, e.g. [0, 1, 2, 3]") from None

    @property
    def candidates(self) -> list[int]:
        return branch_candidates(self.tcfg.num_steps, self.tcfg.branch_steps)

    def branch_step(self, group: int) -> int:
        """Group ``group``'s branching step this training step (keyed by (seed, step, group): every rank and
        a resumed run draw alike)."""
        return draw_branch_step(self.candidates, self.keyed_generator(group, 23))

    def sampling(self, group: int) -> Sampling:
        """ODE everywhere but the group's branching step, an SDE step there."""
        return Sampling(self.sampler, self.noise_level, (self.branch_step(group), 1), False,
                        keep_unconditional=self.reuses_unconditional)

    def collect(self, step: int) -> StepBatch:
        batch = super().collect(step)
        ks = [c.trained_steps()[0] for c in batch.chunks]
        batch.logs["branch_step"] = float(sum(ks) / len(ks))
        return batch

    def trained_steps(self, chunk: Rollout) -> list[int]:
        """The branching step (``timestep_fraction`` does not apply)."""
        return chunk.trained_steps()

    def step_weight(self, chunk: Rollout, k: int) -> float:
        """``w_k`` of :func:`~flowalign.sampling.branching.noise_aware_weights` (1 without noise_weighting)."""
        if not self.tcfg.noise_weighting:
            return 1.0
        return noise_aware_weights(chunk.sigmas, self.candidates, self.sampler, self.noise_level)[k]

    def surrogate(self, chunk: Rollout, k: int, out: StepOutput, old_log_prob: torch.Tensor, adv: torch.Tensor,
                  weight: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        scaled = adv if weight is None else adv * weight
        return weighted_clip_loss(out.log_prob, old_log_prob, scaled, self.tcfg.clip_range,
                                  self.step_weight(chunk, k))
