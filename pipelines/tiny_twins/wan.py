"""Tiny Wan 2.1 T2V pipeline: 3D DiT with cross-attention, causal 3D VAE, UMT5 stand-in."""

from __future__ import annotations

from typing import Any

from pipelines.tiny_twins.base import T5_STANDIN, merge, scalar_options, seeded, t5_config
from pipelines.tiny_tokenizers import t5_tokenizer



WAN_DEFAULTS: dict[str, Any] = {
    "seed": 0,
    "t5_max_length": 32,
    "t5_extra_words": (),
    "transformer": {
        "patch_size": [1, 2, 2],
        "num_attention_heads": 2,
        "attention_head_dim": 24,  # RoPE splits it t/h/w = 8/8/8
        "freq_dim": 32,
        "ffn_dim": 64,
        "num_layers": 2,
        "cross_attn_norm": True,
        "qk_norm": "rms_norm_across_heads",
        "rope_max_seq_len": 64,
    },
    # Wan 2.1 causal 3D VAE, f_t = 2 ** sum(temperal_downsample), f_s = 2 ** len(temperal_downsample)
    "vae": {
        "base_dim": 8,
        "z_dim": 4,
        "dim_mult": [1, 2, 2],
        "num_res_blocks": 1,
        "attn_scales": [],
        "temperal_downsample": [False, True],
    },
    "text_encoder": dict(T5_STANDIN),  # UMT5-XXL stand-in
    "scheduler": {"num_train_timesteps": 1000, "shift": 3.0},
}


def build_tiny_wan(**overrides):
    """A tiny ``WanPipeline`` (Wan 2.1 T2V-like: 3D DiT with cross-attention, causal 3D VAE, UMT5).

    Overrides as :func:`build_tiny_sd3` with components ``transformer``, ``vae``, ``text_encoder``,
    ``scheduler``. ``num_frames - 1`` must be divisible by the VAE's temporal factor (2 by default).
    """
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    o = scalar_options("wan", WAN_DEFAULTS, overrides)
    vae_cfg = merge(WAN_DEFAULTS["vae"], overrides.get("vae"))
    z = vae_cfg["z_dim"]
    vae_cfg.setdefault("latents_mean", [0.0] * z)
    vae_cfg.setdefault("latents_std", [1.0] * z)
    vae_cfg.setdefault("scale_factor_temporal", 2 ** sum(bool(t) for t in vae_cfg["temperal_downsample"]))
    vae_cfg.setdefault("scale_factor_spatial", 2 ** len(vae_cfg["temperal_downsample"]))
    tok = t5_tokenizer(o["t5_max_length"], tuple(o["t5_extra_words"]))
    te = t5_config(merge(WAN_DEFAULTS["text_encoder"], overrides.get("text_encoder")), tok)
    tr = merge(WAN_DEFAULTS["transformer"], overrides.get("transformer"))
    tr.setdefault("in_channels", z)
    tr.setdefault("out_channels", z)
    tr.setdefault("text_dim", te["d_model"])
    tr["patch_size"] = tuple(tr["patch_size"])
    sched = merge(WAN_DEFAULTS["scheduler"], overrides.get("scheduler"))

    with seeded(o["seed"]):
        transformer = WanTransformer3DModel(**tr)
        vae = AutoencoderKLWan(**vae_cfg)
        text_encoder = UMT5EncoderModel(UMT5Config(**te))
    pipe = WanPipeline(
        tokenizer=tok,
        text_encoder=text_encoder.eval(),
        transformer=transformer,
        vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(**sched),
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


#: the sampling defaults written next to the tiny model (``flowalign.json``)
SAMPLING: dict[str, Any] = {"height": 32, "width": 32, "num_frames": 5, "guidance_scale": 5.0, "num_steps": 20,
                            "max_sequence_length": 32, "shift": 3.0}
#: the builder :func:`pipelines.tiny.build_tiny` calls
build = build_tiny_wan
