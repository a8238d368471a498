"""DanceGRPO's σ grid and integer timesteps (DanceGRPO, and Pref-GRPO and MixGRPO, whose scripts are built on
DanceGRPO's).

Their scripts sample on ``sd3_time_shift(shift, linspace(1, 0, T + 1))`` whatever the model (``--shift 3`` for
FLUX, Wan, Qwen-Image; 5 for HunyuanVideo), not the checkpoint's own grid, and hand the transformer
``int(1000·σ)`` (a ``torch.long``; FLUX that integer over 1000) in rollouts and updates alike
(``docs/methods/dance_grpo.md``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from flowalign.config import Section, changed
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

    @model_validator(mode="after")
    def _shift_only_with_the_shifted_grid(self):
        if changed(self, "sigma_shift") and self.sigma_grid != "shifted":
            raise ValueError(f"trainer.sigma_shift is read only with trainer.sigma_grid=shifted (this config has "
                             f"{self.sigma_grid}): drop it or set trainer.sigma_grid=shifted")
        return self


class DanceSchedule:
    """Trainer hooks read by Flow-GRPO's sampling and forwards; mixed in before ``FlowGRPOTrainer``, whose config
    then carries :class:`DanceScheduleOptions`."""

    @property
    def rollout_grid(self) -> ShiftedGrid | None:
        """The authors' shifted grid (``sigma_grid: shifted``), or None: the checkpoint's own."""
        return ShiftedGrid(self.tcfg.sigma_shift) if self.tcfg.sigma_grid == "shifted" else None

    @property
    def timestep_form(self) -> TimestepMap | None:
        """Their integer timestep (``model_timestep: truncated``), or None: the pipeline's ``1000·σ``."""
        return truncated if self.tcfg.model_timestep == "truncated" else None
