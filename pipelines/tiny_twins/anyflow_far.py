"""Tiny AnyFlow-FAR twin: ``AnyFlowFARPipeline`` with every component shrunk, real classes throughout.

``AnyFlowFARTransformer3DModel`` (causal Wan DiT with FAR's compressed far-context patches and the
dual-timestep flow-map embedding), with the tiny Wan twin's causal 3D ``AutoencoderKLWan``, UMT5 stand-in and
tokenizer, and ``FlowMapEulerDiscreteScheduler``. Five latent frames stream as chunks of 1, 2 and 2 with two
full-resolution chunks kept (the release: 21 frames as 1 + 3·6 + 2, three kept), so the third chunk already
sees the first in compressed form.
"""

from __future__ import annotations

from typing import Any

from pipelines.tiny_twins.base import check_keys, merge, seeded

DEFAULTS: dict[str, Any] = {
    "seed": 0,
    # the release: 40 heads x 128, 40 layers, ffn 13824 (Wan 2.1-14B), patches (1,2,2) / (1,4,4)
    "transformer": {"patch_size": [1, 2, 2], "compressed_patch_size": [1, 4, 4], "full_chunk_limit": 2,
                    "num_attention_heads": 2, "attention_head_dim": 24, "freq_dim": 32, "ffn_dim": 64,
                    "num_layers": 2, "rope_max_seq_len": 64, "chunk_partition": [1, 2, 2]},
    # the release: shift 5 (Wan 2.1 at 720p)
    "scheduler": {"num_train_timesteps": 1000, "shift": 3.0},
}

#: 9 frames at 32 x 32 (five latent frames, the three chunks above), 4 flow-map steps, no CFG
SAMPLING: dict[str, Any] = {"height": 32, "width": 32, "num_frames": 9, "guidance_scale": 1.0, "num_steps": 4,
                            "shift": 3.0, "chunk_partition": [1, 2, 2]}


def build(**overrides):
    """A tiny ``AnyFlowFARPipeline``; ``overrides`` replace whole ``transformer`` / ``scheduler`` configs or
    ``seed`` (the VAE and text encoder are the tiny Wan twin's)."""
    from diffusers import AnyFlowFARPipeline, AnyFlowFARTransformer3DModel, FlowMapEulerDiscreteScheduler

    from pipelines.tiny_twins.wan import build_tiny_wan

    check_keys("anyflow_far", overrides, set(DEFAULTS))
    seed = overrides.get("seed", DEFAULTS["seed"])
    wan = build_tiny_wan(seed=seed)
    tr = merge(DEFAULTS["transformer"], overrides.get("transformer"))
    z = wan.vae.config.z_dim
    tr.update(in_channels=z, out_channels=z, text_dim=wan.text_encoder.config.d_model,
              patch_size=tuple(tr["patch_size"]), compressed_patch_size=tuple(tr["compressed_patch_size"]),
              chunk_partition=tuple(tr["chunk_partition"]))
    with seeded(seed):
        transformer = AnyFlowFARTransformer3DModel(**tr)
    pipe = AnyFlowFARPipeline(tokenizer=wan.tokenizer, text_encoder=wan.text_encoder, transformer=transformer,
                              vae=wan.vae,
                              scheduler=FlowMapEulerDiscreteScheduler(**merge(DEFAULTS["scheduler"],
                                                                              overrides.get("scheduler"))))
    pipe.set_progress_bar_config(disable=True)
    return pipe
