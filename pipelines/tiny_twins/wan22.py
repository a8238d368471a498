"""Tiny Wan 2.2-A14B twin: ``WanPipeline`` with two experts (``transformer`` for high noise, ``transformer_2``
for low noise) and ``boundary_ratio``, over the tiny Wan 2.1-style VAE and UMT5 of :func:`pipelines.tiny.build_tiny_wan`.
"""

from __future__ import annotations

from typing import Any

#: Wan2.2-T2V-A14B's boundary (model_index.json)
BOUNDARY_RATIO = 0.875
#: A14B's published guidance (4.0 high-noise, 3.0 low-noise), fewer steps for the tiny model
SAMPLING: dict[str, Any] = {"height": 32, "width": 32, "num_frames": 5, "guidance_scale": 4.0,
                            "guidance_scale_2": 3.0, "num_steps": 20, "max_sequence_length": 32}


def build(boundary_ratio: float = BOUNDARY_RATIO, **overrides):
    """A tiny two-expert ``WanPipeline``: the experts share the config, not the weights (seeds differ)."""
    from diffusers import WanPipeline, WanTransformer3DModel

    from pipelines.tiny_twins.base import seeded
    from pipelines.tiny_twins.wan import build_tiny_wan

    base = build_tiny_wan(**overrides)
    with seeded(int(overrides.get("seed", 0)) + 1):
        transformer_2 = WanTransformer3DModel(**base.transformer.config)
    pipe = WanPipeline(
        tokenizer=base.tokenizer, text_encoder=base.text_encoder, transformer=base.transformer, vae=base.vae,
        scheduler=base.scheduler, transformer_2=transformer_2, boundary_ratio=boundary_ratio,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe
