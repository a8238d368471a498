"""DanceGRPO (arXiv 2505.07818): a preset of Flow-GRPO (``docs/methods/dance_grpo.md``).

The loss is Flow-GRPO's clipped surrogate, unchanged (here without the KL term by default); what
DanceGRPO changes is around it:

- every rollout of a prompt group starts from the same ``x_T`` (``shared_initial_noise``);
- its SDE (sampler ``"dance"``): ``μ = x + Δ·[v − (η²/2)·∇log p]``, ``τ = η·sqrt(−Δ)``, on every step;
- per sample (or per rollout batch, ``step_draw``) and epoch, ``⌊timestep_fraction·(T−1)⌋`` of the first T−1
  steps drawn at random are trained (the authors' scripts never train the step to σ = 0;
  :mod:`flowalign.trainers.parts.drawn_steps`);
- group advantages take the unbiased std + 1e-8, as the authors' ``Tensor.std()`` (``advantage_std``);
- optionally only the best and worst ``best_of / 2`` samples of each group are trained
  (:mod:`flowalign.trainers.parts.best_worst`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from flowalign.limits import MAX_COEFFICIENT
from flowalign.sampling import Rollout
from flowalign.trainers.base import StepBatch
from flowalign.trainers.flow_grpo import CPSOptions, FlowGRPOBase, FlowGRPOTrainer, SDEOptions, SDEWindowOptions
from flowalign.trainers.options import ReferenceOptions
from flowalign.trainers.parts.best_worst import BestWorstOptions, best_and_worst, check_best_of
from flowalign.trainers.parts.drawn_steps import (
    DrawnStepOptions,
    check_drawn_steps,
    drawn_reference_steps,
    drawn_steps,
    per_sample_batch,
)
from flowalign.trainers.parts.global_plan import ChunkRef


class DanceGRPOConfig(FlowGRPOBase, ReferenceOptions, SDEOptions, CPSOptions, SDEWindowOptions, DrawnStepOptions,
                      BestWorstOptions):
    name: Literal["dance_grpo"] = "dance_grpo"
    sampler: Literal["dance", "flow_grpo", "cps"] = "dance"  # type: ignore[assignment]
    #: η of the DanceGRPO SDE (0.3 FLUX, 0.25 HunyuanVideo in the authors' scripts)
    noise_level: float = Field(0.3, gt=0, le=2)
    beta: float = Field(0.0, ge=0, le=MAX_COEFFICIENT)
    shared_initial_noise: bool = True
    advantage: str = Field("group", pattern="^(group|global_std|gdpo|win_rate)$")
    #: the std of ``group`` / ``global_std`` advantages: "unbiased" + 1e-8 (the authors' ``Tensor.std()``) or
    #: "population" + 1e-4 (Flow-GRPO's)
    advantage_std: Literal["unbiased", "population"] = "unbiased"


class DanceGRPOTrainer(FlowGRPOTrainer):
    Config = DanceGRPOConfig
    tcfg: DanceGRPOConfig

    @classmethod
    def reference_steps(cls, tcfg: DanceGRPOConfig) -> int:
        """``⌊timestep_fraction·(T−1)⌋`` drawn steps an epoch (:func:`drawn_reference_steps`)."""
        return drawn_reference_steps(tcfg)

    @classmethod
    def check_config(cls, cfg, tcfg) -> None:
        super().check_config(cfg, tcfg)
        check_drawn_steps(tcfg)
        check_best_of(tcfg)

    def advantage_options(self) -> dict[str, Any]:
        return {"unbiased": True, "eps": 1e-8} if self.tcfg.advantage_std == "unbiased" else {}

    def collect(self, step: int) -> StepBatch:
        """The loop's batch; with ``best_of`` the other samples' advantages are zeroed (not trained); with
        ``step_draw: per_sample`` split into one-sample chunks (:func:`per_sample_batch`)."""
        batch = super().collect(step)
        batch = best_and_worst(batch, self.tcfg.best_of) if self.tcfg.best_of else batch
        return per_sample_batch(batch) if self.tcfg.step_draw == "per_sample" else batch

    def trained_steps(self, chunk: Rollout) -> list[int]:
        """Every stochastic step is a candidate (the random draw is in :meth:`chosen_steps`)."""
        return chunk.trained_steps()

    def chosen_steps(self, chunk: ChunkRef, epoch: int) -> list[int]:
        """:func:`~flowalign.trainers.parts.drawn_steps.drawn_steps` of the chunk, drawn as Flow-GRPO's
        ``steps_per_chunk`` draws them (keyed by the chunk's identity and the epoch, so the draw does not
        depend on the rank layout)."""
        return drawn_steps(chunk.steps, self.tcfg.num_steps, self.tcfg.timestep_fraction,
                           self.keyed_generator(*chunk.key, epoch, 17))
