"""The deterministic weights the registers' known answers were drawn with, for the authors' model and ours alike."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch


def seeded_fill(named: Iterable[tuple[str, torch.nn.Parameter]], seed: int) -> None:
    """Every parameter from one generator, in sorted-name order (the draw the known answers used): matrices
    scaled by 1/√fan-in, norm weights near 1, biases and other vectors near 0."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(named, key=lambda kv: kv[0]):
            noise = torch.randn(p.shape, generator=gen)
            if p.ndim >= 2:
                p.copy_(noise / math.sqrt(p.numel() // p.shape[0]))
            elif name.endswith("weight"):
                p.copy_(1.0 + 0.1 * noise)
            else:
                p.copy_(0.1 * noise)
