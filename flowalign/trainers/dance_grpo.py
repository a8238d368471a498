"""DanceGRPO (arXiv 2505.07818): a preset of Flow-GRPO (``docs/methods/dance_grpo.md``).

The loss is Flow-GRPO's clipped surrogate, unchanged (here without the KL term by default); what
DanceGRPO changes is around it:

- every rollout of a prompt group starts from the same ``x_T`` (``shared_initial_noise``);
- its SDE (sampler ``"dance"``): ``μ = x + Δ·[v − (η²/2)·∇log p]``, ``τ = η·sqrt(−Δ)``, on every step;
- their σ grid, ``linspace(1, 0, T + 1)`` shifted by 3, and the transformer reading ``int(1000·σ)``
  (:mod:`flowalign.trainers.parts.dance_schedule`);
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
from flowalign.trainers.flow_grpo import CPSOptions, FlowGRPOBase, FlowGRPOTrainer, SDEOptions, SDEWindowOptions
from flowalign.trainers.options import ReferenceOptions
from flowalign.trainers.parts.advantage_std import AdvantageStdOptions, advantage_std_options
from flowalign.trainers.parts.best_worst import BestWorstOptions
from flowalign.trainers.parts.dance_loop import DanceLoop
from flowalign.trainers.parts.dance_schedule import DanceScheduleOptions
from flowalign.trainers.parts.drawn_steps import DrawnStepOptions


class DanceGRPOConfig(FlowGRPOBase, ReferenceOptions, SDEOptions, CPSOptions, SDEWindowOptions, DrawnStepOptions,
                      BestWorstOptions, AdvantageStdOptions, DanceScheduleOptions):
    name: Literal["dance_grpo"] = "dance_grpo"
    #: what runs saved before these options existed computed (see TrainerConfig.before)
    before = {"step_draw": "per_batch", "advantage_std": "population", "zero_advantage": "skipped",
              "sigma_grid": "model", "model_timestep": "continuous"}
    sampler: Literal["dance", "flow_grpo", "cps"] = "dance"  # type: ignore[assignment]
    #: η of the DanceGRPO SDE (0.3 FLUX, 0.25 HunyuanVideo in the authors' scripts)
    noise_level: float = Field(0.3, gt=0, le=2)
    beta: float = Field(0.0, ge=0, le=MAX_COEFFICIENT)
    #: CFG's gradient: "full", through both branches of the one [cond; uncond] pass, as the authors' grpo_one_step
    #: computes it (their Wan, FLUX.2 klein, Z-Image and HunyuanVideo scripts run CFG in the update); "detached"
    #: (Flow-GRPO's, the conditional branch only) is the former form
    cfg_grad: Literal["detached", "full"] = "full"
    shared_initial_noise: bool = True
    advantage: str = Field("group", pattern="^(group|global_std|per_reward|gdpo|win_rate)$")


class DanceGRPOTrainer(DanceLoop, FlowGRPOTrainer):
    Config = DanceGRPOConfig
    tcfg: DanceGRPOConfig

    def advantage_options(self) -> dict[str, Any]:
        """The authors' unbiased std + 1e-8 (:func:`advantage_std_options`)."""
        return advantage_std_options(self.tcfg)
