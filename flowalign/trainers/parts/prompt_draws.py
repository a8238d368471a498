"""A step's prompts drawn as fresh, independent batches of distinct prompts, as the Flow-OPD authors' sampler
(``DistributedKRepeatSampler``, CostaliyA/Flow-OPD @ 434ab16) draws a batch's prompts: a prompt may come again
in the next draw, never twice within one."""

from __future__ import annotations

from typing import Callable

import torch


def per_batch_draw(size: int, count: int, per_draw: int, generator: Callable[[int], torch.Generator]) -> list[int]:
    """``count`` indices into a source of ``size`` prompts, as the authors' sampler draws a batch's prompts:
    draw ``b`` = 0, 1, … takes the first ``per_draw`` of ``torch.randperm(size)`` under ``generator(b)``
    (distinct within a draw, independent across draws), the draws concatenated and cut to ``count``. Their
    sampler seeds its generator ``42 + set_epoch`` once per batch; the caller keys ``generator(b)`` instead."""
    out: list[int] = []
    b = 0
    while len(out) < count:
        out += torch.randperm(size, generator=generator(b))[:per_draw].tolist()
        b += 1
    return out[:count]
