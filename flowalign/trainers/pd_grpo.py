"""PD-GRPO, pairwise dual-group relative optimisation, on the generator (``docs/methods/pd_grpo.md``).

From *Think Before You Score* (the Thinking Reward Model paper): pairwise supervision sharpens which sample
is better, pointwise scores keep by how much. Here both become group-relative advantages of one rollout
group and are mixed (:func:`flowalign.advantages.dual_group_advantages`):

    A_i = (1 − λ)·(R_i − mean_g R)/(std_g R + eps) + λ·(W_i − mean_g W)/(std_g W + eps)

with ``R`` the pointwise reward (e.g. ``vlm_judge`` in ``mode: think``), ``W`` the within-group win rate
(a pairwise judge's value, or the pointwise scores compared two by two) and ``λ = pairwise_weight``. The
loss is Flow-GRPO's clipped surrogate (with its KL term), unchanged; λ = 0 trains exactly as
``flow_grpo`` with ``advantage: group``, λ = 1 as its ``win_rate`` advantage (Pref-GRPO's).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from flowalign.trainers.flow_grpo import FlowGRPOConfig, FlowGRPOTrainer
from flowalign.trainers.parts.groups import check_whole_groups


class PDGRPOConfig(FlowGRPOConfig):
    name: Literal["pd_grpo"] = "pd_grpo"  # type: ignore[assignment]
    #: the method's advantage: the pointwise and the pairwise group mixed (see the module docstring)
    advantage: Literal["dual"] = "dual"  # type: ignore[assignment]
    #: λ, the pairwise group's share of the advantage (0: pointwise only, 1: pairwise only)
    pairwise_weight: float = Field(0.5, ge=0, le=1)


class PDGRPOTrainer(FlowGRPOTrainer):
    Config = PDGRPOConfig
    tcfg: PDGRPOConfig

    @classmethod
    def check_config(cls, cfg, tcfg) -> None:
        super().check_config(cfg, tcfg)
        check_whole_groups(tcfg)

    def advantage_options(self) -> dict[str, Any]:
        return {"pairwise_weight": self.tcfg.pairwise_weight}
