"""Micro-batches that each inner epoch re-forms from a step's samples, as the Flow-OPD authors' loop does
(``scripts/train_sd3_opd_mix.py`` @ 434ab16, l. 1468-1479: ``samples = samples[randperm]``, then ``batch_size``
rows at a time), read back out of the step's rollout chunks.

:func:`inner_epoch_micro_batches` says which rows form each inner epoch's micro-batches; :class:`Regrouped`
reads a micro-batch's trajectories and the step means computed per rollout chunk at its rows.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Callable

import torch

from flowalign.sampling import Rollout


def inner_epoch_micro_batches(chunks: list[Rollout], batch_size: int, inner_epochs: int,
                              generator: Callable[[int], torch.Generator]) -> list[list[tuple[int, ...]]]:
    """Each inner epoch's micro-batches as rows of the step batch that ``chunks`` hold (batch order).

    Epoch 0 is the rollout chunks themselves. Epoch e ≥ 1 permutes epoch e − 1's order again by
    ``generator(e)``, so the permutations compose as the authors' do, and cuts it into ``batch_size`` rows at a
    time. Samples rolled out with different SDE steps (an ``sde_window`` per group) never share a micro-batch:
    each such kind is cut on its own, in order."""
    sizes = [len(c) for c in chunks]
    n = sum(sizes)
    epochs = [[tuple(rows.tolist()) for rows in torch.arange(n).split(sizes)]]
    kinds = [tuple(c.sde_mask.tolist()) for c in chunks for _ in range(len(c))]
    order = torch.arange(n)
    for epoch in range(1, inner_epochs):
        order = order[torch.randperm(n, generator=generator(epoch))]
        buckets: dict[tuple[bool, ...], list[int]] = {}
        for r in order.tolist():
            buckets.setdefault(kinds[r], []).append(r)
        epochs.append([tuple(rows[i : i + batch_size]) for rows in buckets.values()
                       for i in range(0, len(rows), batch_size)])
    return epochs


@dataclass(eq=False)
class Regrouped:
    """A step's samples read as re-formed micro-batches: each row's ``(chunk, place in it)`` in ``where``
    (batch order), the step means the plan computed per ``(chunk, step)`` (``teacher``,
    ``reference``; empty under fsdp, where the loss computes them), and the micro-batch in use, gathered once
    for its units."""

    chunks: list[Rollout]
    where: list[tuple[int, int]]
    teacher: dict[tuple[int, int], torch.Tensor]
    reference: dict[tuple[int, int], torch.Tensor]
    kept: tuple[tuple[int, ...], Rollout] | None = None

    def rollout(self, rows: tuple[int, ...]) -> Rollout:
        """The rows' samples, in that order, as one rollout of ``len(rows)`` (decoded samples left out: training
        reads the trajectories). The last one asked for is kept: a micro-batch's units follow one another."""
        if self.kept is None or self.kept[0] != rows:
            self.kept = None  # the previous micro-batch's copy goes before the next is gathered
            parts = []
            for c, run in itertools.groupby(rows, key=lambda r: self.where[r][0]):
                chunk = dataclasses.replace(self.chunks[c], samples=None)
                parts.append(chunk.select([self.where[r][1] for r in run]))
            self.kept = (rows, Rollout.cat(parts))
        return self.kept[1]

    def means(self, which: str, rows: tuple[int, ...], k: int) -> torch.Tensor | None:
        """``(B, ...)`` the rows' step means at step ``k`` from the plan's per-chunk ones (``which``: "teacher" or
        "reference"), zeros for a row of a chunk none was computed for (the plan computes every chunk with a
        trained row here, so only untrained rows, which the loss masks out); None when none was computed."""
        means = getattr(self, which)
        found = [means.get((self.where[r][0], k)) for r in rows]
        like = next((m for m in found if m is not None), None)
        if like is None:
            return None
        return torch.stack([m[self.where[r][1]] if m is not None else torch.zeros_like(like[0])
                            for m, r in zip(found, rows)])
