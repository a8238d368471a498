"""KV routing of a streaming stream's history: which earlier chunks a branch's chunks attend to.

Two forms. :func:`window_routings` is the KVPO authors' (``DiversitySamplingPipeline.plan_perturbation`` and
``_build_dispersed_branch_plans``, with ``CausalWanSelfAttention._build_perturbed_local_window``): every branch
keeps the attention sink and the ``nearest`` most recent chunks, and in place of the rest of its history
attends to ``older`` chunks drawn from the older pool; one permutation of the pool is shared by the group and
branch ``g`` takes the ``older`` entries starting at ``g·max(1, pool // G)``, so branches overlap as little as
the pool allows. The drawn chunks stay the same over a window of consecutive chunks, the nearest ones follow
the chunk being generated (:func:`window_keep`). :func:`bernoulli_routing` keeps each earlier chunk with a
probability, at one chunk.
"""

from __future__ import annotations

import torch


def window_pool(chunk: int, nearest: int, keep_sink: bool) -> list[int]:
    """The older chunks a branch at ``chunk`` may draw from: after the sink, before the ``nearest`` chunks."""
    return list(range(1 if keep_sink else 0, max(chunk - nearest, 0)))


def window_routable(chunk: int, nearest: int, older: int, keep_sink: bool) -> bool:
    """Whether routing at ``chunk`` can change a branch's history: the pool holds more chunks than are drawn.

    Theirs asks for a pool of at least ``older`` frames beyond a sliding attention window; a streaming model
    that attends to its whole history changes nothing when every pool chunk is drawn, hence the strict ``>``."""
    return chunk >= 1 and len(window_pool(chunk, nearest, keep_sink)) > older


def window_routings(chunk: int, group_size: int, nearest: int, older: int, keep_sink: bool,
                    generator: torch.Generator) -> list[tuple[int, ...]]:
    """The older chunks each of ``group_size`` branches attends to at ``chunk`` (sorted, absolute indices):
    ``min(older, |pool|)`` consecutive entries, cyclically, of one permutation of the pool drawn from
    ``generator``, branch ``g`` starting at ``g·max(1, |pool| // group_size)``."""
    pool = window_pool(chunk, nearest, keep_sink)
    take = min(older, len(pool))
    if take <= 0:
        return [() for _ in range(group_size)]
    perm = torch.randperm(len(pool), generator=generator).tolist()
    shift = max(1, len(pool) // group_size)
    return [tuple(sorted(pool[perm[(g * shift + i) % len(pool)]] for i in range(take))) for g in range(group_size)]


def window_keep(chunk: int, drawn: tuple[int, ...], nearest: int, keep_sink: bool) -> tuple[int, ...]:
    """What chunk ``chunk`` of a routed window attends to: the sink, the drawn older chunks and its ``nearest``
    most recent chunks (those generated inside the window among them)."""
    sink = {0} if keep_sink and chunk > 0 else set()
    return tuple(sorted(sink | set(drawn) | set(range(max(chunk - nearest, 0), chunk))))


def bernoulli_routing(chunk: int, keep_prob: float, keep_sink: bool, generator: torch.Generator) -> tuple[int, ...]:
    """The history chunks ``0..chunk−1`` one branch keeps: each with probability ``keep_prob``, chunk 0 always
    when ``keep_sink``."""
    kept = (torch.rand(chunk, generator=generator) < keep_prob).tolist()
    return tuple(j for j in range(chunk) if kept[j] or (keep_sink and j == 0))
