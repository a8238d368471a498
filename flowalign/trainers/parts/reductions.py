"""Reductions of per-element losses."""

from __future__ import annotations

import torch


def per_sample_mean(x: torch.Tensor) -> torch.Tensor:
    """``mean(·)`` over the non-batch elements: ``(B, ...)`` → ``(B,)``."""
    return x.flatten(1).mean(1)
