"""Pref-GRPO (arXiv 2508.20751): GRPO on pairwise-preference win rates (``docs/methods/pref_grpo.md``).

The advantage changes, not the loss (:func:`flowalign.advantages.preference_win_rates`): within each
prompt group every sample is compared with every other, its reward is its win rate
``W_i = (1/(G−1)) Σ_{j≠i} 1[i ≻ j]`` (a tie counts ½), and the advantage is the win rate normalised within
the group, ``A_i = (W_i − mean_g W)/(std_g W + eps)``. The comparisons come from a pairwise judge
(a reward whose ``pairwise`` attribute is true, e.g. ``unified_reward`` with ``mode: think_pairwise``, whose
value already is the win rate) or, for any other reward, from comparing its scores. The rest is the
authors' DanceGRPO-based loop (:mod:`flowalign.trainers.dance_grpo`): shared initial noise per group, a
random ``timestep_fraction`` of the steps trained, and Flow-GRPO's clipped surrogate unchanged:

    L = mean_{i,k} max(−A_i·r, −A_i·clip(r, 1−ε, 1+ε)),   r = exp(ℓ_k(θ) − ℓ_k(θ_old))
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from flowalign.trainers.dance_grpo import DanceGRPOConfig, DanceGRPOTrainer
from flowalign.trainers.parts.groups import check_whole_groups


class PrefGRPOConfig(DanceGRPOConfig):
    name: Literal["pref_grpo"] = "pref_grpo"  # type: ignore[assignment]
    #: the authors' scripts step with Flow-GRPO's SDE (grpo_step_mode flow, eta 0.7)
    sampler: Literal["flow_grpo", "dance", "cps"] = "flow_grpo"  # type: ignore[assignment]
    noise_level: float = Field(0.7, gt=0, le=2)
    #: the method's advantage: group-normalised win rates (see the module docstring)
    advantage: Literal["win_rate"] = "win_rate"  # type: ignore[assignment]


class PrefGRPOTrainer(DanceGRPOTrainer):
    Config = PrefGRPOConfig
    tcfg: PrefGRPOConfig

    @classmethod
    def check_config(cls, cfg, tcfg) -> None:
        super().check_config(cfg, tcfg)
        check_whole_groups(tcfg)


