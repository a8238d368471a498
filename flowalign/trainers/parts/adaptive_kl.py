"""An adaptive KL weight: β moved after each step toward a target KL (Pref-GRPO's video scripts, ``--kl_adaptive``).

The step's mean KL ``k`` (over every rank's trained units, as the loss logs them) updates an average,
``e ← k`` on the first step, then ``e ← (1 − α)·e + α·k``; with a target ``κ > 0`` the weight becomes

    β ← clamp(β·exp((e − κ)/κ / H), β_min, β_max)

(``H`` the horizon) and is what the next step's loss reads; with ``κ = 0`` β stays. β and ``e`` are saved with
the trainer's state, so a resumed run goes on with the same weight.
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import Field, model_validator

from flowalign.config import Section, changed
from flowalign.limits import MAX_COEFFICIENT


class AdaptiveKLOptions(Section):
    """The controller's settings, named as the authors' flags (``--kl_target`` …); off by default."""

    #: move β toward kl_target after every step (the trainer's beta is its starting value)
    kl_adaptive: bool = False
    #: the step's mean KL the controller steers toward (0: β stays)
    kl_target: float = Field(0.0, ge=0, le=MAX_COEFFICIENT)
    #: steps over which a relative KL error of 1 moves β by a factor e
    kl_horizon: int = Field(100, ge=1, le=1_000_000)
    #: the weight of each step's KL in the running average the controller reads
    kl_ema_alpha: float = Field(0.2, ge=0, le=1)
    #: the lowest β the controller sets
    kl_beta_min: float = Field(0.0, ge=0, le=MAX_COEFFICIENT)
    #: the highest β the controller sets
    kl_beta_max: float = Field(MAX_COEFFICIENT, ge=0, le=MAX_COEFFICIENT)

    @model_validator(mode="after")
    def _starts_from_beta(self):
        settings = ("kl_target", "kl_horizon", "kl_ema_alpha", "kl_beta_min", "kl_beta_max")
        if not self.kl_adaptive and any(changed(self, name) for name in settings):
            given = ", ".join(name for name in settings if changed(self, name))
            raise ValueError(f"trainer.{given} set the adaptive KL controller, which is off: add trainer.kl_adaptive: "
                             "true or drop them")
        if self.kl_adaptive and getattr(self, "beta", 0.0) <= 0:
            raise ValueError("trainer.kl_adaptive moves the KL weight from trainer.beta, which is 0 here: give "
                             "trainer.beta its starting value (> 0), or kl_adaptive: false")
        if self.kl_beta_min > self.kl_beta_max:
            raise ValueError(f"trainer.kl_beta_min ({self.kl_beta_min}) is above trainer.kl_beta_max "
                             f"({self.kl_beta_max}): give a range with min <= max")
        return self


def next_kl_weight(beta: float, average: float | None, kl: float, tcfg: AdaptiveKLOptions) -> tuple[float, float]:
    """``(β, e)`` after a step whose mean KL is ``kl``, from ``β`` and the average ``e`` (None before the first
    step); see the module docstring."""
    average = kl if average is None else (1.0 - tcfg.kl_ema_alpha) * average + tcfg.kl_ema_alpha * kl
    if tcfg.kl_target <= 0:
        return beta, average
    error = (average - tcfg.kl_target) / max(tcfg.kl_target, 1e-12)
    beta *= math.exp(error / tcfg.kl_horizon)
    return min(max(beta, tcfg.kl_beta_min), tcfg.kl_beta_max), average


class AdaptiveKL:
    """Trainer hooks: mixed in before ``FlowGRPOTrainer``, whose config then carries :class:`AdaptiveKLOptions`;
    the loss reads :meth:`kl_coefficient`."""

    kl_weight: float | None = None
    kl_average: float | None = None

    def kl_coefficient(self) -> float:
        """The KL term's weight for this step: β as the controller left it, else the configured beta."""
        if not self.tcfg.kl_adaptive or self.kl_weight is None:  # type: ignore[attr-defined]
            return self.tcfg.beta  # type: ignore[attr-defined]
        return self.kl_weight

    def finish(self, batch: Any, steps: list[dict[str, list[float]]]) -> dict[str, float]:
        """The controller's update from the step's mean KL over every rank's units (decided alike on every
        rank), then the next step's β logged as ``kl_beta``."""
        out = super().finish(batch, steps)  # type: ignore[misc]
        if not self.tcfg.kl_adaptive:  # type: ignore[attr-defined]
            return out
        total, count = 0.0, 0
        for kl, n in self.gather_objects((sum(sum(s.get("kl", [])) for s in steps),  # type: ignore[attr-defined]
                                          sum(len(s.get("kl", [])) for s in steps))):
            total, count = total + kl, count + n
        if count:
            self.kl_weight, self.kl_average = next_kl_weight(self.kl_coefficient(), self.kl_average, total / count,
                                                             self.tcfg)  # type: ignore[attr-defined]
        return {**out, "kl_beta": self.kl_coefficient()}

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()  # type: ignore[misc]
        if self.tcfg.kl_adaptive:  # type: ignore[attr-defined]
            state.update({"kl_beta": self.kl_weight, "kl_average": self.kl_average})
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)  # type: ignore[misc]
        if self.tcfg.kl_adaptive:  # type: ignore[attr-defined]
            self.kl_weight, self.kl_average = state.get("kl_beta"), state.get("kl_average")
