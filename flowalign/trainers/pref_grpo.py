"""Pref-GRPO (arXiv 2508.20751): GRPO on pairwise-preference win rates (``docs/methods/pref_grpo.md``).

The advantage changes, not the loss (:func:`flowalign.advantages.per_reward_win_rate_advantages`, as the
authors' ``compute_weighted_advantages``): within each prompt group every sample is compared with every other,
each reward's value is its win rate ``W_i = round((1/(G−1)) Σ_{j≠i} 1[i ≻ j], 3)`` (a tie counts ½), each
reward's win rates are normalised within the group, ``A^(m)_i = (W_i − mean_g W)/(std_g W + 1e-8)`` with the
unbiased std, weighted, summed and (``batch_renormalise``, their ``--apply_gdpo``) renormalised over the
batch. The former form is ``win_rate_normalisation: weighted_sum`` with ``batch_renormalise: false``: the
weighted sum of win rates, unrounded, normalised per group with the population std + 1e-4. The comparisons
come from a pairwise judge (a reward whose ``pairwise`` attribute is true, e.g. ``unified_reward`` with
``mode: think_pairwise``, whose value already is the win rate) or, for any other reward, from comparing its
scores. The rest is the authors' DanceGRPO-based loop, a preset of Flow-GRPO as ``dance_grpo`` is: shared initial noise per group, a
random ``timestep_fraction`` of the first T−1 steps trained, drawn per sample, and optionally only each group's
best and worst samples (:mod:`flowalign.trainers.parts.dance_loop`), and
Flow-GRPO's clipped surrogate with GRPO-Guard's normalised ratio r̃ and 1/h step weight, as their scripts'
``--rationorm`` (:mod:`flowalign.trainers.parts.ratio_norm`; ``ratio_norm: false``, ``reweight: false`` is the
former form, the plain ratio):

    L = mean_{i,k} (1/h_k)·max(−A_i·r̃, −A_i·clip(r̃, 1−ε, 1+ε))
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from flowalign.advantages import PointwiseRewards, WinRateNormalisation
from flowalign.config import changed
from flowalign.limits import MAX_COEFFICIENT
from flowalign.trainers.flow_grpo import CPSOptions, FlowGRPOBase, FlowGRPOTrainer, SDEOptions, SDEWindowOptions
from flowalign.trainers.options import ReferenceOptions
from flowalign.trainers.parts.adaptive_kl import AdaptiveKL, AdaptiveKLOptions
from flowalign.trainers.parts.best_worst import BestWorstOptions
from flowalign.trainers.parts.dance_loop import DanceLoop
from flowalign.trainers.parts.dance_schedule import DanceScheduleOptions
from flowalign.trainers.parts.drawn_steps import DrawnStepOptions
from flowalign.trainers.parts.groups import check_whole_groups
from flowalign.trainers.parts.ratio_norm import RatioNorm, RatioNormOptions


class PrefGRPOConfig(FlowGRPOBase, ReferenceOptions, SDEOptions, CPSOptions, SDEWindowOptions, DrawnStepOptions,
                     BestWorstOptions, DanceScheduleOptions, RatioNormOptions, AdaptiveKLOptions):
    name: Literal["pref_grpo"] = "pref_grpo"
    #: what runs saved before these options existed computed (see TrainerConfig.before)
    before = {"step_draw": "per_batch", "zero_advantage": "skipped", "win_rate_normalisation": "weighted_sum",
              "batch_renormalise": False, "sigma_grid": "model", "model_timestep": "continuous",
              "ratio_norm": False, "reweight": False, "pointwise_rewards": "win_rates", "kl_mode": "code"}
    #: their --rationorm (on in their _common_finetune.sh): GRPO-Guard's normalised ratio with each sample's own
    #: shift (their mean over the elements of a one-sample batch) and the loss divided by the σ gap
    ratio_bias: Literal["batch", "sample"] = "sample"
    #: the authors' scripts step with Flow-GRPO's SDE (grpo_step_mode flow, eta 0.7)
    sampler: Literal["flow_grpo", "dance", "cps"] = "flow_grpo"  # type: ignore[assignment]
    noise_level: float = Field(0.7, gt=0, le=2)
    beta: float = Field(0.0, ge=0, le=MAX_COEFFICIENT)
    #: with beta > 0: their compute_kl_loss, mean_D Δμ²/(2τ²) with τ the step's noise ("mean"); "code" is
    #: Flow-GRPO's coded KL (that times the σ gap), the former form
    kl_mode: Literal["mean", "code", "exact"] = "mean"  # type: ignore[assignment]
    #: CFG's gradient: "full", through both branches of the one [cond; uncond] pass, as the authors' grpo_one_step
    #: computes it (their Wan, FLUX.2 klein, Z-Image and HunyuanVideo scripts run CFG in the update); "detached"
    #: (Flow-GRPO's, the conditional branch only) is the former form
    cfg_grad: Literal["detached", "full"] = "full"
    shared_initial_noise: bool = True
    #: the method's advantage: group-normalised win rates (see the module docstring)
    advantage: Literal["win_rate"] = "win_rate"  # type: ignore[assignment]
    #: per_reward: each reward's win rates normalised in its group (unbiased std + 1e-8), then weighted and
    #: summed, as the authors' code; weighted_sum: the weighted sum of win rates normalised (population std + 1e-4)
    win_rate_normalisation: WinRateNormalisation = "per_reward"
    #: the advantages renormalised over the whole batch, unbiased std + 1e-8 (their --apply_gdpo, on in their recipes)
    batch_renormalise: bool = True
    #: per_reward: what is normalised of a reward that is not a pairwise judge (e.g. their CLIP beside the judge):
    #: "scores", its raw scores, as their compute_weighted_advantages; "win_rates", the win rates its scores give
    pointwise_rewards: PointwiseRewards = "scores"

    @model_validator(mode="after")
    def _pointwise_only_per_reward(self):
        if changed(self, "pointwise_rewards") and self.win_rate_normalisation != "per_reward":
            raise ValueError("trainer.pointwise_rewards is read only with trainer.win_rate_normalisation=per_reward "
                             f"(this config has {self.win_rate_normalisation}, which compares every reward into win "
                             "rates): drop it or set win_rate_normalisation: per_reward")
        return self


class PrefGRPOTrainer(DanceLoop, AdaptiveKL, RatioNorm, FlowGRPOTrainer):
    Config = PrefGRPOConfig
    tcfg: PrefGRPOConfig

    @classmethod
    def check_config(cls, cfg, tcfg) -> None:
        super().check_config(cfg, tcfg)
        check_whole_groups(tcfg)

    def advantage_options(self) -> dict[str, Any]:
        return {"win_rate_normalisation": self.tcfg.win_rate_normalisation,
                "batch_renormalise": self.tcfg.batch_renormalise, "pointwise_rewards": self.tcfg.pointwise_rewards}
