"""DiffSynth-Studio's flow-matching SFT levels for FLUX.2 (``sft`` with ``timesteps: diffsynth_flux2``).

The CrossTimeEdit authors fine-tune FLUX.2 [klein] with DiffSynth-Studio (079e51c), whose ``FlowMatchSFTLoss``
draws a training level uniformly from its scheduler's 1000 and weights the squared error by the scheduler's
training weight. For FLUX.2 the scheduler (``FlowMatchScheduler("FLUX.2").set_timesteps(1000, training=True)``)
holds

    s_i = linspace(1, 1/1000, 1000)_i,   σ_i = e^μ / (e^μ + 1/s_i − 1)  with μ = 0.8,   t_i = 1000·σ_i
    w_i = (y_i − min y) · 1000 / Σ_j (y_j − min y),   y_i = exp(−2·((t_i − 500)/1000)²)

(``set_timesteps_flux2``, ``set_training_weight``: mean 1, 0 at σ = 1, largest near σ = 0.48). The level is
drawn as an index ``i``, but the timestep is then cast to the pipeline's dtype, and the noisy state
``(1 − σ)·x0 + σ·ε`` and the weight are read at the level nearest that cast timestep (``add_noise`` and
``training_weight`` look it up by ``argmin``): in bf16 most levels above σ ≈ 0.25 share their cast timestep
with a neighbour, so 616 of the 1000 draws read another level than drawn. The model is handed the cast
timestep over 1000. :func:`diffsynth_flux2_levels` computes the same from a drawn index.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

#: the FLUX.2 template's fixed shift (DiffSynth's ``set_timesteps_flux2`` without ``dynamic_shift_len``)
FLUX2_MU = 0.8
#: the scheduler's training levels
LEVELS = 1000


def flux2_training_grid() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(σ, timesteps, weights)``, each ``(1000,)`` float32: DiffSynth's FLUX.2 training scheduler."""
    s = torch.linspace(1.0, 1.0 / LEVELS, LEVELS)
    sigmas = math.exp(FLUX2_MU) / (math.exp(FLUX2_MU) + (1 / s - 1))
    timesteps = sigmas * LEVELS
    y = torch.exp(-2 * ((timesteps - LEVELS / 2) / LEVELS) ** 2)
    shifted = y - y.min()
    return sigmas, timesteps, shifted * (LEVELS / shifted.sum())


@dataclass
class TrainingLevels:
    """Per pair ``(B,)`` float32: the noisy state's ``sigma``, the ``model_sigma`` the model is handed and the
    squared error's ``weight``."""

    sigma: torch.Tensor
    model_sigma: torch.Tensor
    weight: torch.Tensor


def diffsynth_flux2_levels(index: torch.Tensor, dtype: torch.dtype) -> TrainingLevels:
    """The levels of drawn indices ``index (B,)`` (uniform in 0 … 999) under a pipeline in ``dtype``."""
    sigmas, timesteps, weights = flux2_training_grid()
    cast = timesteps[index].to(dtype).float()
    read = (timesteps[None, :] - cast[:, None]).abs().argmin(1)  # the first nearest, as torch.argmin
    return TrainingLevels(sigmas[read], cast / LEVELS, weights[read])


def weighted_errors(velocity: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], x0: torch.Tensor, eps: torch.Tensor,
                    levels: TrainingLevels) -> tuple[torch.Tensor, torch.Tensor]:
    """``FlowMatchSFTLoss`` per pair: ``(w·e, e)``, each ``(B,)``, with ``e = mean‖v(x_σ, σ_model) − (ε − x0)‖²``
    over a pair's elements and ``x_σ = (1 − σ)·x0 + σ·ε``; ``x0, eps (B, ...)``; ``velocity(x, σ (B,))``."""
    sigma = levels.sigma.reshape(-1, *([1] * (x0.ndim - 1))).to(x0)
    x_sigma = (1 - sigma) * x0 + sigma * eps
    error = (velocity(x_sigma, levels.model_sigma).float() - (eps - x0).float()).pow(2).flatten(1).mean(1)
    return levels.weight.to(error) * error, error
