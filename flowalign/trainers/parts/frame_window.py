"""KVPO's routed window in frames, on a streaming model whose cache routes single frames (LongLive's causal Wan):
the model's geometry and the trainer's options, and what a branch routed at a chunk reads
(:mod:`flowalign.trainers.parts.kv_routing` holds the authors' rules it applies)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from flowalign.errors import UserError
from flowalign.protocols import KeptFrames
from flowalign.trainers.parts.kv_routing import dispersed_draws, frame_keep, frame_pool, frame_routable, slot_shift


@dataclass
class FrameWindow:
    """``sink`` frames a branch keeps (the model's ``sink_frames`` when ``keep_sink``), ``nearest`` (the chunk
    being made among them), ``older`` frames drawn, the pool bounded by a ``resident`` cache of that many frames
    (their training cache), the model's attention ``window`` and resident ``cache`` (None: every frame), and
    whether drawn frames are read where their slots put them (``code_reads``)."""

    policy: Any
    sink: int
    nearest: int
    older: int
    resident: int | None
    window: int | None
    cache: int | None
    code_reads: bool

    @classmethod
    def of(cls, policy: Any, tcfg: Any) -> "FrameWindow":
        """The window of trainer options ``tcfg`` (``nearest_frames``, ``older_frames``, ``resident_frames``,
        ``keep_sink``, ``pool_reads``) on ``policy``; refused in one line where it cannot hold."""
        if not getattr(policy, "routes_frames", False):
            raise UserError(f"trainer.nearest_frames={tcfg.nearest_frames}: this {policy.family!r} streaming model "
                            "routes its history in whole chunks; use trainer.nearest_chunks and trainer.older_chunks")
        per = max(policy.chunk_frames)
        if tcfg.nearest_frames < per:
            raise UserError(f"trainer.nearest_frames={tcfg.nearest_frames}: the nearest frames count the chunk "
                            f"being made ({per} frames, as their m_nearest_frames counts the block); give at least "
                            f"{per}")
        window = getattr(policy, "window", None)
        sink = int(getattr(policy, "sink", 0)) if tcfg.keep_sink else 0
        older = tcfg.older_frames
        if older is None:
            if window is None:
                raise UserError("trainer.older_frames: this model attends to its whole history (no attention "
                                "window to fill), so give the older frames a branch draws")
            older = max(window - sink - tcfg.nearest_frames, 0)
        cache = getattr(policy, "cache_frames", None)
        resident = cache if tcfg.resident_frames is None else tcfg.resident_frames
        if resident is not None and resident <= sink:
            raise UserError(f"trainer.resident_frames={resident}: the resident cache holds the sink ({sink} frames) "
                            "and more; theirs is 33")
        if cache is not None and resident > cache:
            raise UserError(f"trainer.resident_frames={resident}: the model's resident cache holds {cache} frames "
                            f"(model.defaults.cache_frames); set it to {resident} (theirs: local_attn_size + "
                            "slice_last_frames = 33 in training)")
        return cls(policy, sink, tcfg.nearest_frames, older, resident, window, cache, tcfg.pool_reads == "code")

    def span(self, chunk: int, chunks: int) -> tuple[int, int]:
        """The first frame of ``chunk`` and of the last of the ``chunks`` chunks routed from it."""
        return self.policy.chunk_slice(chunk).start, self.policy.chunk_slice(chunk + chunks - 1).start

    def shift(self, chunk: int) -> int:
        """How many frames later than drawn a branch routed at ``chunk`` reads (:func:`slot_shift`; 0 when reading
        the drawn frames)."""
        if not self.code_reads:
            return 0
        return slot_shift(self.policy.chunk_slice(chunk).start, self.policy.chunk_frames[chunk], self.resident,
                          int(getattr(self.policy, "sink", 0)))

    def pool(self, chunk: int, chunks: int) -> list[int]:
        """The older frames a branch routed at ``chunk`` for ``chunks`` chunks draws from (:func:`frame_pool`),
        those whose read frame the model's resident cache still holds when ``chunk`` is made (their pool can
        name frames their cache no longer holds, read through :func:`slot_shift`)."""
        start, last = self.span(chunk, chunks)
        pool = frame_pool(start, last, self.nearest, self.sink, self.resident)
        if self.cache is None:
            return pool
        first = start + self.policy.chunk_frames[chunk] - (self.cache - int(getattr(self.policy, "sink", 0)))
        shift = self.shift(chunk)
        return [f for f in pool if f + shift >= first]

    def routable(self, chunk: int, chunks: int) -> bool:
        """Their eligibility (:func:`frame_routable`), with a pool of ``older`` frames the cache holds."""
        return (frame_routable(*self.span(chunk, chunks), self.nearest, self.older, self.sink, self.resident,
                               self.window) and len(self.pool(chunk, chunks)) >= self.older)

    def routes(self, chunk: int, chunks: int, group_size: int, generator: torch.Generator
               ) -> list[Callable[[int], tuple[int, ...] | KeptFrames]]:
        """Per branch, what chunk ``c ≥ chunk`` reads: in the window, the sink, the frames drawn for the branch
        (:func:`dispersed_draws`, read ``shift`` frames later) and its nearest frames; after it, every chunk."""
        policy, end, shift = self.policy, chunk + chunks, self.shift(chunk)
        return [lambda c, drawn=tuple(f + shift for f in drawn): (
                    frame_keep(policy.chunk_slice(c).start, policy.chunk_frames[c], drawn, self.nearest, self.sink)
                    if c < end else tuple(range(c)))
                for drawn in dispersed_draws(self.pool(chunk, chunks), group_size, self.older, generator)]
