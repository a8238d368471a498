"""The flow-matching scheduler's training grid, as SD3-style training scripts index it.

A freshly loaded ``FlowMatchEulerDiscreteScheduler`` (no ``set_timesteps`` yet) holds ``T`` noise levels
(``num_train_timesteps``, 1000 for SD3): ``s_i = (T - i)/T`` for ``i = 0 … T-1``, shifted to
``shift·s/(1 + (shift-1)·s)`` unless the config shifts dynamically, stored float32 from 1 down to ``σ(1/T)``,
and the transformer's timestep at level ``i`` is ``T·σ_i``. A training time ``t ∈ [0, 1]`` (1 = noise) picks
level ``floor((1-t)·T)`` (clamped to the grid), so training sees the shifted, quantised ``σ`` and never σ = 0.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


def training_grid(policy: Any) -> torch.Tensor:
    """``(T,)`` float32 noise levels, 1 → σ(1/T), of the policy's scheduler as loaded for training.

    A policy without a ``scheduler`` gets the 1000-level grid with ``defaults["shift"]`` (1.0 when absent).
    """
    scheduler = getattr(policy, "scheduler", None)
    config = dict(getattr(scheduler, "config", {}) or {})
    levels = int(config.get("num_train_timesteps", 1000))
    shift = 1.0 if config.get("use_dynamic_shifting", False) else float(config.get("shift", policy.defaults.get("shift", 1.0)))
    # float32 numpy then torch, as the scheduler builds it, so the levels are the same bits
    s = torch.from_numpy(np.linspace(1, levels, levels, dtype=np.float32)[::-1].copy()) / levels
    return shift * s / (1 + (shift - 1) * s)


def grid_sigma(t: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """``(B,)`` grid noise levels of training times ``t (B,)`` (1 = noise): level ``floor((1-t)·T)``, in
    ``t``'s dtype (the float32 arithmetic decides which level a time on a boundary picks)."""
    levels = grid.shape[0]
    index = ((1.0 - t) * levels).long().clamp(0, levels - 1)
    return grid.to(device=t.device, dtype=t.dtype)[index]


def grid_sigma_of(sigma: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """``(B,)`` the grid level a model is run at for an off-grid noise level ``sigma (B,)``.

    The level is found as a training time and read back through :func:`grid_sigma`: the first grid level
    at or below σ gives ``t = 1 - i/T`` in float32, whose rounding sends about a sixth of the levels one
    step noisier (the level above σ). A training script that maps σ this way runs its model there.
    """
    levels = grid.shape[0]
    ordered = grid.to(device=sigma.device, dtype=sigma.dtype)
    index = torch.searchsorted(-ordered, -sigma).clamp(0, levels - 1)
    return grid_sigma(1.0 - index.float() / levels, grid).to(sigma.dtype)
