"""Tiny FLUX.1 Kontext twin: the tiny FLUX.1-dev components of :func:`pipelines.tiny.build_tiny_flux` in a
``FluxKontextPipeline`` (Kontext-dev is FLUX.1-dev's architecture with context-image tokens)."""

from __future__ import annotations

from typing import Any

#: FLUX.1-Kontext-dev's model card: guidance 2.5 (embedded), 28 steps; fewer for the tiny model
SAMPLING: dict[str, Any] = {"height": 32, "width": 32, "num_frames": None, "guidance_scale": 2.5, "num_steps": 20,
                            "max_sequence_length": 32}


def build(**overrides):
    """A tiny ``FluxKontextPipeline`` (same overrides as ``build_tiny_flux``)."""
    from diffusers import FluxKontextPipeline

    from pipelines.tiny_twins.flux1 import build_tiny_flux

    base = build_tiny_flux(**overrides)
    pipe = FluxKontextPipeline(**{k: v for k, v in base.components.items() if k not in ("image_encoder", "feature_extractor")})
    pipe.set_progress_bar_config(disable=True)
    return pipe
