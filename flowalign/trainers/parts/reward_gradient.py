"""Gradients of differentiable rewards with respect to latents, through the VAE decoder."""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from flowalign.reward_set import RewardSet


def pixel_reward_gradient(policy, rewards, prompts: list[str], metadata: list[dict], checkpointing: bool = True):
    """``y ↦ ∇_y Σ_j w_j R_j(D(y), c)`` ``(B, ...)``: through the VAE decoder (checkpointed), never θ.

    ``rewards``: a :class:`RewardSet` (or its ``(name, weight, reward)`` triples); invalid samples
    contribute no gradient.
    """
    rewards = RewardSet.of(rewards)

    def grad_fn(y: torch.Tensor) -> torch.Tensor:
        with torch.enable_grad():
            y = y.detach().requires_grad_(True)
            images = checkpoint(policy.decode, y, use_reentrant=False) if checkpointing else policy.decode(y)
            total = rewards.weighted_total(images, prompts, metadata)
            if not total.requires_grad:  # e.g. a batch of counts under vvr_soft(count_gradients=False)
                return torch.zeros_like(y)
            (g,) = torch.autograd.grad(total.sum(), y, allow_unused=True)
        return torch.zeros_like(y) if g is None else g.detach()

    return grad_fn
