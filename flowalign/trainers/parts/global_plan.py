"""A plan of optimiser steps over every rank's rollout batches, the same on every rank."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch


@dataclass(frozen=True, order=True)
class ChunkRef:
    """One rollout batch of the global batch, as every rank sees it: ``key`` (group, member) of its first
    sample (its identity in any rank layout), the ``rank`` holding it and its ``index`` there, whether any
    sample has a non-zero advantage, and its trainable steps."""

    key: tuple[int, int]
    rank: int
    index: int
    active: bool
    steps: tuple[int, ...]


def global_plan(chunks: list[ChunkRef], inner_epochs: int, updates_per_epoch: int, generator: torch.Generator,
                chosen: Callable[[ChunkRef, int], list[int]],
                count_inactive: bool = False) -> list[list[tuple[ChunkRef, int]]]:
    """The optimiser steps over every rank's chunks, each a list of (chunk, trained step) pairs.

    Per inner epoch the chunks, in key order, are permuted by ``generator`` (the same on every rank), the
    active ones split into ``updates_per_epoch`` steps, and ``chosen(chunk, epoch)`` picks each chunk's
    trained steps. Neither depends on which rank holds a chunk, so every rank computes the same plan,
    and so does one process holding all the chunks.

    ``count_inactive``: every chunk takes its place in the split and its pairs stay in its step, so they count
    in the step's size (the caller runs only the active ones: an inactive chunk's gradient is zero); a step
    with no active chunk stays in the plan, an optimiser step on a zero gradient (AdamW's moments and weight
    decay still move the weights), as in a loop that runs every sample. Without it, inactive chunks are
    not in the split and a step with none of the others is left out.
    """
    chunks = sorted(chunks)
    steps: list[list[tuple[ChunkRef, int]]] = []
    for epoch in range(inner_epochs):
        order = torch.randperm(len(chunks), generator=generator).tolist()
        split = [chunks[i] for i in order if count_inactive or chunks[i].active]
        for part in np.array_split(np.arange(len(split)), updates_per_epoch):
            if len(part) and (count_inactive or any(split[j].active for j in part.tolist())):
                steps.append([(split[j], k) for j in part.tolist() for k in chosen(split[j], epoch)])
    return steps
