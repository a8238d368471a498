"""DanceGRPO's σ grid and integer timesteps (DanceGRPO, and Pref-GRPO whose scripts are DanceGRPO's).

Their scripts sample on ``sd3_time_shift(shift, linspace(1, 0, T + 1))`` whatever the model (``--shift 3`` for
FLUX, Wan, Qwen-Image; 5 for HunyuanVideo), not the checkpoint's own grid, and hand the transformer
``int(1000·σ)`` (a ``torch.long``; FLUX that integer over 1000) in rollouts and updates alike
(``docs/methods/dance_grpo.md``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from flowalign.config import Section
from flowalign.sampling.timesteps import ShiftedGrid, TimestepMap, truncated


class DanceScheduleOptions(Section):
    """The rollouts' σ grid and the timestep the transformer reads."""

    #: shifted: linspace(1, 0, T + 1) time-shifted by sigma_shift, as the authors' scripts; model: the
    #: checkpoint's own grid (its scheduler's shift, FLUX's resolution-dependent one)
    sigma_grid: Literal["shifted", "model"] = "shifted"
    #: the shifted grid's shift (the authors' --shift: 3 for FLUX, Wan and Qwen-Image, 5 for HunyuanVideo)
    sigma_shift: float = Field(3.0, gt=0, le=100)
    #: truncated: the transformer reads int(1000·σ) (FLUX: over 1000) in rollouts and updates, as the authors'
    #: scripts; continuous: the pipeline's 1000·σ
    model_timestep: Literal["truncated", "continuous"] = "truncated"


def schedule_grid(tcfg: DanceScheduleOptions) -> ShiftedGrid | None:
    """The rollouts' σ grid (None: the checkpoint's own)."""
    return ShiftedGrid(tcfg.sigma_shift) if tcfg.sigma_grid == "shifted" else None


def schedule_timestep(tcfg: DanceScheduleOptions) -> TimestepMap | None:
    """What the transformer reads of its timestep (None: the pipeline's ``1000·σ``)."""
    return truncated if tcfg.model_timestep == "truncated" else None
