"""DiffusionNFT's negative-aware fine-tuning loss: the reward weight ``r`` of an advantage, the velocities
mirrored around a behaviour policy's, and the loss that pulls the mirrored positive policy toward the data's
velocity on good samples and the negative one on bad ones (DiffusionNFT trains on it; DiffusionOPSD mirrors its
velocities; AFD turns its discriminator's advantage into it)."""

from __future__ import annotations

from typing import Literal

import torch

from flowalign.trainers.parts.reductions import per_sample_mean

#: ``x0_normalised``: the DiffusionNFT authors' x0-space, error-normalised form; ``velocity``: the loss on velocities
NFTLossForm = Literal["x0_normalised", "velocity"]


def reward_weight(adv: torch.Tensor, a_max: float) -> torch.Tensor:
    """``r = clip(clip(A, −A_max, A_max)/(2·A_max) + 1/2, 0, 1)`` ``(B,)``."""
    return (adv.clamp(-a_max, a_max) / (2 * a_max) + 0.5).clamp(0, 1)


def mirrored_velocities(v_theta: torch.Tensor, v_phi: torch.Tensor, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``v⁺ = β·v_θ + (1−β)·v_φ`` and ``v⁻ = (1+β)·v_φ − β·v_θ`` (``v_φ`` detached by the caller)."""
    return beta * v_theta + (1 - beta) * v_phi, (1 + beta) * v_phi - beta * v_theta


def adaptive_x0_loss(x0_hat: torch.Tensor, x0: torch.Tensor) -> torch.Tensor:
    """``mean((x̂0 − x0)²/w)`` ``(B,)`` with ``w = max(mean|x̂0 − x0|, 1e-5)`` per sample, computed in float64 and
    without gradient, as the authors' adaptive weighting."""
    with torch.no_grad():
        weight = (x0_hat.double() - x0.double()).abs().flatten(1).mean(1).clip(min=1e-5)
    weight = weight.view(-1, *([1] * (x0.ndim - 1)))
    return per_sample_mean((x0_hat - x0) ** 2 / weight)


def nft_loss(
    v_theta: torch.Tensor, v_phi: torch.Tensor, x_t: torch.Tensor, x0: torch.Tensor, eps: torch.Tensor,
    t: torch.Tensor, r: torch.Tensor, beta: float, adv_clip: float, form: NFTLossForm = "x0_normalised",
    v_ref: torch.Tensor | None = None, kl_beta: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-sample NFT loss ``(B,)``.

    ``v_theta``, ``v_phi``, ``x_t``, ``x0``, ``eps``, ``v_ref``: ``(B, ...)``; ``t``, ``r``: ``(B,)``; ``beta``: the
    mirror β; ``adv_clip``: A_max. ``x0_normalised`` (the authors'): ``(A_max/β)·[r·L⁺ + (1−r)·L⁻]`` with
    :func:`adaptive_x0_loss` on ``x̂0± = x_t − t·v±``; ``velocity``: ``r·mean(v⁺ − v)² + (1−r)·mean(v⁻ − v)²``.
    With ``v_ref``, ``kl_beta·mean((v_θ − v_ref)²)`` is added.
    """
    v_pos, v_neg = mirrored_velocities(v_theta, v_phi.detach(), beta)
    if form == "velocity":
        target = eps - x0
        pos, neg = per_sample_mean((v_pos - target) ** 2), per_sample_mean((v_neg - target) ** 2)
        loss = r * pos + (1 - r) * neg
    else:
        t = t.view(-1, *([1] * (x0.ndim - 1)))
        pos = adaptive_x0_loss(x_t - t * v_pos, x0)
        neg = adaptive_x0_loss(x_t - t * v_neg, x0)
        loss = (r * pos / beta + (1 - r) * neg / beta) * adv_clip
    info = {"loss_pos": pos.detach().mean(), "loss_neg": neg.detach().mean()}
    if v_ref is not None:
        kl = per_sample_mean((v_theta - v_ref.detach()) ** 2)
        loss = loss + kl_beta * kl
        info["kl"] = kl.detach().mean()
    return loss, info
