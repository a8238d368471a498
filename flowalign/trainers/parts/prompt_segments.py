"""Streams that switch prompts (LongLive's interactive streams, KVPO's training streams): each prompt of the data
gives its segments (a JSONL ``{"prompts": [...]}`` line), the stream switching to the next at each of the
trainer's ``switch_frames`` (latent frames, theirs ``switch_frame_indices``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from flowalign.errors import UserError
from flowalign.sampling.streaming import switch_chunks


@dataclass
class PromptSegments:
    """``frames``: the switch frames; ``chunks``: the chunk each next segment starts at (empty: one prompt)."""

    frames: list[int]
    chunks: list[int]

    @classmethod
    def of(cls, policy: Any, switch_frames: list[int] | None, metadata: list[dict[str, Any]]) -> "PromptSegments":
        """The segments of ``switch_frames`` on ``policy``; every prompt's ``metadata`` is checked to hold its
        segments, and the model to recache under a new prompt, refused in one line otherwise."""
        if not switch_frames:
            return cls([], [])
        if not hasattr(policy, "switch_prompt"):
            raise UserError(f"trainer.switch_frames: this {policy.family!r} streaming model streams one prompt a "
                            "video (no recache under a new prompt); drop it, or use a causal Wan (LongLive)")
        need = len(switch_frames) + 1
        for i, meta in enumerate(metadata, 1):
            segments = meta.get("prompts")
            if not isinstance(segments, list) or len(segments) < need:
                have = len(segments) if isinstance(segments, list) else 1
                raise UserError(f"trainer.switch_frames={switch_frames}: prompt {i} of data.prompts has {have} "
                                f"prompt segment(s), each needs {need}; give a JSONL file of "
                                '{"prompts": [segment, ...]} lines')
        return cls(list(switch_frames), sorted(switch_chunks(policy, [(f, ["-"]) for f in switch_frames], 1)))

    def __bool__(self) -> bool:
        return bool(self.chunks)

    def of_prompt(self, meta: dict[str, Any]) -> list[str]:
        """A prompt's segments, in order (none when streams keep one prompt)."""
        return list(meta["prompts"][:len(self.chunks) + 1]) if self.chunks else []

    def switches(self, meta: dict[str, Any]) -> list[tuple[int, list[str]]] | None:
        """``stream_rollout``'s switches of a prompt's stream (None: one prompt)."""
        if not self.chunks:
            return None
        return [(f, [p]) for f, p in zip(self.frames, self.of_prompt(meta)[1:])]

    def history(self, meta: dict[str, Any], chunk: int) -> list[tuple[int, str]]:
        """``(first chunk, prompt)`` of each of a prompt's segments that starts by ``chunk`` (the last is the one
        ``chunk`` follows); empty when streams keep one prompt."""
        return [(c, p) for c, p in zip([0, *self.chunks], self.of_prompt(meta)) if c <= chunk]

    def crosses(self, chunk: int, chunks: int) -> bool:
        """Whether ``chunks`` chunks from ``chunk`` on cross a switch (one at ``chunk`` itself does not)."""
        return any(chunk < c < chunk + chunks for c in self.chunks)


def segment_bounds(total: int, switch_frames: list[int], stride: int) -> list[tuple[int, int, int]]:
    """``(segment, a, b)``: the decoded frames [a, b) of each prompt segment of a video of ``total`` frames that
    switched prompts at latent ``switch_frames`` (a latent frame ``f ≥ 1`` starts at decoded frame
    ``f·stride − (stride − 1)``, the VAE's temporal ``stride``), segments of fewer than 2 frames left out (their
    ``_build_global_segment_clip_specs``)."""
    cuts = [f * stride - (stride - 1) for f in switch_frames]
    edges = [0] + [c for c in cuts if 0 < c < total] + [total]
    return [(i, a, b) for i, (a, b) in enumerate(zip(edges, edges[1:])) if b - a >= 2]
