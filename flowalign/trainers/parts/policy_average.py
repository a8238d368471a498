"""A moving average of the trained weights whose decay ramps up with the optimiser steps taken,
``d = min(cap, 0.001·s)``: the average follows the policy closely at first and lags it more as training goes
on. AWM's authors regularise toward it (a KL target); DGPO's take their ratio clip's "old" losses from it
and, late in training, sample with it."""

from __future__ import annotations

from typing import Literal

#: the slope of the "linear" decay schedule, per optimiser step (both authors' scripts)
RAMP = 0.001


def ramped_decay(optimizer_steps: int, cap: float, schedule: Literal["linear", "constant"] = "linear") -> float:
    """d of the average after ``optimizer_steps`` steps: ``min(cap, 0.001·s)`` ("linear") or ``cap``
    ("constant")."""
    return min(cap, RAMP * optimizer_steps) if schedule == "linear" else cap
