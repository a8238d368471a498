"""Tiny causal Wan twin: the tiny Wan 2.1 ``WanPipeline`` marked as a causal streaming generator
(:mod:`pipelines.causal_wan`), so it loads as :class:`pipelines.causal_wan.CausalWanPolicy`.

Random weights (an architecture twin of Self-Forcing / LongLive's Wan 2.1-1.3B generator at tiny widths); nine
latent frames stream as three chunks of three, as the releases' 21 stream as seven.
"""

from __future__ import annotations

from typing import Any

from pipelines.causal_wan import MARKER, MARKER_KEY
from pipelines.tiny_twins.wan import build_tiny_wan

#: 17 frames at 32 x 32 (nine latent frames with the tiny VAE's temporal factor 2), their 4-step grid at shift 5,
#: no CFG, global attention (Self-Forcing's); LongLive's window is ``attention_window: 12, sink_frames: 3``
SAMPLING: dict[str, Any] = {"height": 32, "width": 32, "num_frames": 17, "guidance_scale": 1.0, "num_steps": 4,
                            "max_sequence_length": 32, "shift": 5.0, "chunk_frames": 3}


def build(**overrides: Any):
    """A tiny ``WanPipeline`` marked causal; ``overrides`` as :func:`pipelines.tiny_twins.wan.build_tiny_wan`."""
    pipe = build_tiny_wan(**{"scheduler": {"num_train_timesteps": 1000, "shift": 5.0}, **overrides})
    pipe.register_to_config(**{MARKER_KEY: MARKER})
    return pipe
