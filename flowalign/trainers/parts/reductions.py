"""Reductions of per-element losses."""

from __future__ import annotations

import torch


def per_sample_mean(x: torch.Tensor) -> torch.Tensor:
    """``mean(·)`` over the non-batch elements: ``(B, ...)`` → ``(B,)``."""
    return x.flatten(1).mean(1)


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The mean of ``x`` ``(B,)`` over the entries where ``mask`` ``(B,)`` is true (0 where none is), as
    ``x[mask].mean()`` but with no boolean index: that one's size depends on the mask's values, so on a GPU
    it makes the host wait for the device (forward and backward)."""
    return torch.where(mask, x, 0.0).sum() / mask.sum().clamp(min=1)


def masked_max(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The largest of a non-negative ``x`` ``(B,)`` over ``mask`` (0 where the mask is empty), with no boolean
    index (see :func:`masked_mean`)."""
    return torch.where(mask, x, 0.0).max()
