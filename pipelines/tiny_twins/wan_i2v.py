"""Tiny Wan 2.2 I2V-A14B twin: ``WanImageToVideoPipeline`` with two experts whose input is the noisy latent,
``f_t`` first-frame mask channels and the first frame's latent (no CLIP image encoder, as the release)."""

from __future__ import annotations

from typing import Any

#: Wan2.2-I2V-A14B's boundary (model_index.json)
BOUNDARY_RATIO = 0.9
#: Wan2.2-I2V-A14B's published guidance: 3.5 for both experts; fewer steps for the tiny model
SAMPLING: dict[str, Any] = {"height": 32, "width": 32, "num_frames": 5, "guidance_scale": 3.5,
                            "guidance_scale_2": 3.5, "num_steps": 20, "max_sequence_length": 32}


def build(boundary_ratio: float = BOUNDARY_RATIO, **overrides):
    """A tiny two-expert ``WanImageToVideoPipeline`` (``in_channels = C + f_t + C``)."""
    from diffusers import WanImageToVideoPipeline, WanTransformer3DModel

    from pipelines.tiny_twins.base import seeded
    from pipelines.tiny_twins.wan import build_tiny_wan

    base = build_tiny_wan(**overrides)
    z = base.vae.config.z_dim
    config = {**base.transformer.config, "in_channels": 2 * z + base.vae_scale_factor_temporal, "out_channels": z}
    config = {k: v for k, v in config.items() if not k.startswith("_")}
    seed = int(overrides.get("seed", 0))
    with seeded(seed + 2):
        transformer = WanTransformer3DModel(**config)
    with seeded(seed + 3):
        transformer_2 = WanTransformer3DModel(**config)
    pipe = WanImageToVideoPipeline(
        tokenizer=base.tokenizer, text_encoder=base.text_encoder, vae=base.vae, scheduler=base.scheduler,
        transformer=transformer, transformer_2=transformer_2, boundary_ratio=boundary_ratio,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe
