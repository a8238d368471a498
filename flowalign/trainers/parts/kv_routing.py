"""KV routing of a streaming stream's history: which earlier chunks (or frames) a branch's chunks attend to.

Two forms. The window is the KVPO authors' (``DiversitySamplingPipeline.plan_perturbation`` and
``_build_dispersed_branch_plans``, with ``CausalWanSelfAttention._build_perturbed_local_window``): every branch
keeps the attention sink and the ``nearest`` most recent frames, and in place of the rest of its history
attends to ``older`` frames drawn from the older pool; one permutation of the pool is shared by the group and
branch ``g`` takes the ``older`` entries starting at ``g·max(1, pool // G)`` (:func:`dispersed_draws`), so
branches overlap as little as the pool allows. The drawn frames stay the same over a window of consecutive
chunks, the nearest ones follow the chunk being generated. In frames, as theirs, for a model whose cache routes
frames (:func:`frame_pool`, :func:`frame_keep`); in whole chunks otherwise (:func:`window_routings`,
:func:`window_keep`). :func:`bernoulli_routing` keeps each earlier chunk with a probability, at one chunk.
"""

from __future__ import annotations

import torch

from flowalign.protocols import KeptFrames


def dispersed_draws(pool: list[int], group_size: int, take: int, generator: torch.Generator) -> list[tuple[int, ...]]:
    """What each of ``group_size`` branches draws from ``pool`` (sorted): ``min(take, |pool|)`` consecutive entries,
    cyclically, of one permutation of the pool drawn from ``generator``, branch ``g`` starting at
    ``g·max(1, |pool| // group_size)`` (their ``_build_dispersed_branch_plans``)."""
    take = min(take, len(pool))
    if take <= 0:
        return [() for _ in range(group_size)]
    perm = torch.randperm(len(pool), generator=generator).tolist()
    shift = max(1, len(pool) // group_size)
    return [tuple(sorted(pool[perm[(g * shift + i) % len(pool)]] for i in range(take))) for g in range(group_size)]


def frame_pool(start: int, last_start: int, nearest: int, sink: int, resident: int | None) -> list[int]:
    """The older frames a branch routed at the chunk starting at frame ``start`` draws from, its window's last
    chunk starting at ``last_start``: after the ``sink`` frames, before the ``nearest`` frames counted back from
    the chunk's start, and (with a resident cache of ``resident`` frames) only frames the cache still holds when
    the window's last chunk is made (their stable pool in ``plan_perturbation``)."""
    first = sink if resident is None else max(sink, last_start - (resident - sink))
    return list(range(first, max(start - nearest, first)))


def frame_routable(start: int, last_start: int, nearest: int, older: int, sink: int, resident: int | None,
                   window: int | None) -> bool:
    """Whether a routed window can start at the chunk starting at frame ``start`` (their eligible start block): the
    history fills the model's attention ``window`` (when it has one) and the pool holds ``older`` frames."""
    return (window is None or start >= window) and start > 0 and \
        len(frame_pool(start, last_start, nearest, sink, resident)) >= older


def slot_shift(start: int, frames: int, cache: int | None, sink: int) -> int:
    """How many frames later than drawn the authors' perturbed window reads its drawn frames at a routed chunk of
    ``frames`` frames starting at frame ``start``, their rolling cache holding ``cache`` frames (None: every
    frame) with a ``sink``. ``_build_perturbed_local_window`` maps a frame to a cache slot counting the chunk
    being made as history, so once the cache is full the slot holds a frame up to one chunk later; 0 before."""
    if cache is None:
        return 0
    local_end = min(start + frames, cache)
    held_first = start + frames - (local_end - sink)  # the frame the first slot after the sink holds
    mapped_first = max(sink, start - (local_end - sink))  # the frame their arithmetic puts there
    return held_first - mapped_first


def frame_keep(start: int, frames: int, drawn: tuple[int, ...], nearest: int, sink: int) -> KeptFrames:
    """What the chunk of ``frames`` frames starting at frame ``start`` reads of its history in a routed window: the
    ``sink`` frames, the drawn ones and the frames before it among its ``nearest`` (which count its own, as
    their ``m_nearest_frames``)."""
    recent = range(max(start - max(nearest - frames, 0), 0), start)
    return KeptFrames(tuple(sorted(set(range(min(sink, start))) | set(drawn) | set(recent))))


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
    """The older chunks each of ``group_size`` branches attends to at ``chunk`` (sorted, absolute indices), drawn
    from the chunks after the sink and before the ``nearest`` ones (:func:`dispersed_draws`)."""
    return dispersed_draws(window_pool(chunk, nearest, keep_sink), group_size, older, generator)


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
