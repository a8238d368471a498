"""Clipped policy-gradient surrogates (PPO's clip, as the GRPO family uses it)."""

from __future__ import annotations

import torch


def ppo_clip_loss(
    log_prob: torch.Tensor, old_log_prob: torch.Tensor, adv: torch.Tensor, clip_range: float,
    weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample clipped surrogate ``max(−w·A·r, −w·A·clip(r))`` ``(B,)``, with the ratio and a clipped flag."""
    ratio = torch.exp(log_prob - old_log_prob)
    scaled = adv if weight is None else adv * weight
    unclipped = -scaled * ratio
    clipped = -scaled * torch.clamp(ratio, 1 - clip_range, 1 + clip_range)
    return torch.maximum(unclipped, clipped), ratio, (clipped > unclipped)


def clipped_loss(log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor,
                 clip_range: float) -> torch.Tensor:
    """``−mean_i min(r_i·A_i, clip(r_i, 1−ε, 1+ε)·A_i)``, ``r_i = exp(log π − log π_old)``: a scalar."""
    ratio = torch.exp(log_probs - old_log_probs)
    clipped = ratio.clamp(1 - clip_range, 1 + clip_range)
    return -torch.minimum(ratio * advantages, clipped * advantages).mean()
