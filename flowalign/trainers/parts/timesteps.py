"""Flow times drawn for fitting losses."""

from __future__ import annotations

import torch


def pair_timesteps(n: int, kind: str, generator: torch.Generator) -> torch.Tensor:
    """``n`` flow times in (0, 1): logit-normal σ(N(0,1)) or uniform."""
    if kind == "uniform":
        return torch.rand(n, generator=generator).clamp(1e-4, 1 - 1e-4)
    return torch.sigmoid(torch.randn(n, generator=generator))
