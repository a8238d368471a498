"""Tiny SD3 / SD3.5 pipeline: MMDiT + SD3 VAE + CLIP-L / CLIP-G / T5 stand-ins."""

from __future__ import annotations

from typing import Any

from pipelines.tiny_twins.base import CLIP_L_STANDIN, T5_STANDIN, clip_config, merge, scalar_options, sd_vae_standin
from pipelines.tiny_twins.base import assemble, seeded, t5_config, vae_config
from pipelines.tiny_tokenizers import clip_tokenizer, t5_tokenizer



SD3_DEFAULTS: dict[str, Any] = {
    "seed": 0,
    "height": 32,
    "clip_vocab_size": 2048,
    "clip_max_length": 77,
    "t5_max_length": 32,
    "t5_extra_words": (),
    # SD3.5-Medium-like: qk RMS-norm and one dual-attention (MMDiT-X) block
    "transformer": {
        "patch_size": 2,
        "in_channels": 4,
        "out_channels": 4,
        "num_layers": 2,
        "attention_head_dim": 16,
        "num_attention_heads": 2,
        "caption_projection_dim": 32,
        "pos_embed_max_size": 16,
        "qk_norm": "rms_norm",
        "dual_attention_layers": [0],
    },
    # SD3-style VAE: no quant convs, scaling + shift factor; f = 2 ** (len(block_out_channels) - 1)
    "vae": sd_vae_standin(scaling_factor=1.5305, shift_factor=0.0609),
    "text_encoder": dict(CLIP_L_STANDIN),  # CLIP-L stand-in
    "text_encoder_2": {  # CLIP-G stand-in
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "projection_dim": 32,
        "hidden_act": "gelu",
    },
    # T5-XXL stand-in, widened: d_model >= sum of CLIP hidden sizes (SD3 pads CLIP to it)
    "text_encoder_3": {**T5_STANDIN, "d_model": 64, "d_kv": 16, "d_ff": 128},
    "scheduler": {"num_train_timesteps": 1000, "shift": 3.0},
}


def build_tiny_sd3(**overrides):
    """A tiny ``StableDiffusion3Pipeline`` (MMDiT + SD3 VAE + CLIP-L/CLIP-G/T5 stand-ins).

    Overrides: ``seed``, ``height`` (image side the transformer's ``sample_size`` is set for),
    ``clip_vocab_size``, ``clip_max_length``, ``t5_max_length``, ``t5_extra_words``, and per-component
    config dicts ``transformer``, ``vae``, ``text_encoder``, ``text_encoder_2``, ``text_encoder_3``,
    ``scheduler`` merged key by key into the defaults. Derived fields (``joint_attention_dim`` = T5
    ``d_model``, ``pooled_projection_dim`` = sum of CLIP projection dims, ``sample_size``) are filled
    in unless given.
    """
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    o = scalar_options("sd3", SD3_DEFAULTS, overrides)
    vae_cfg = vae_config(SD3_DEFAULTS["vae"], overrides.get("vae"))
    f = 2 ** (len(vae_cfg["block_out_channels"]) - 1)
    vae_cfg.setdefault("sample_size", o["height"])

    tok = clip_tokenizer(o["clip_vocab_size"], o["clip_max_length"])
    tok_2 = clip_tokenizer(o["clip_vocab_size"], o["clip_max_length"], pad_token="!")
    tok_3 = t5_tokenizer(o["t5_max_length"], tuple(o["t5_extra_words"]))
    c1 = clip_config(merge(SD3_DEFAULTS["text_encoder"], overrides.get("text_encoder")), tok)
    c2 = clip_config(merge(SD3_DEFAULTS["text_encoder_2"], overrides.get("text_encoder_2")), tok_2)
    t5 = t5_config(merge(SD3_DEFAULTS["text_encoder_3"], overrides.get("text_encoder_3")), tok_3)
    if t5["d_model"] < c1["hidden_size"] + c2["hidden_size"]:
        raise ValueError(
            f"text_encoder_3.d_model={t5['d_model']} must be >= the summed CLIP hidden sizes "
            f"{c1['hidden_size']}+{c2['hidden_size']} (SD3 pads the CLIP states to the T5 width)"
        )
    tr = merge(SD3_DEFAULTS["transformer"], overrides.get("transformer"))
    tr.setdefault("sample_size", o["height"] // f)
    tr.setdefault("joint_attention_dim", t5["d_model"])
    tr.setdefault("pooled_projection_dim", c1["projection_dim"] + c2["projection_dim"])
    tr["dual_attention_layers"] = tuple(tr.get("dual_attention_layers") or ())
    sched = merge(SD3_DEFAULTS["scheduler"], overrides.get("scheduler"))

    with seeded(o["seed"]):
        transformer = SD3Transformer2DModel(**tr)
        vae = AutoencoderKL(**vae_cfg)
        te = CLIPTextModelWithProjection(CLIPTextConfig(**c1))
        te_2 = CLIPTextModelWithProjection(CLIPTextConfig(**c2))
        te_3 = T5EncoderModel(T5Config(**t5))
    return assemble(StableDiffusion3Pipeline, transformer=transformer,
                    scheduler=FlowMatchEulerDiscreteScheduler(**sched), vae=vae, text_encoder=te, tokenizer=tok,
                    text_encoder_2=te_2, tokenizer_2=tok_2, text_encoder_3=te_3, tokenizer_3=tok_3)


#: the sampling defaults written next to the tiny model (``flowalign.json``)
SAMPLING: dict[str, Any] = {"height": 32, "width": 32, "num_frames": None, "guidance_scale": 4.0, "num_steps": 20,
                            "max_sequence_length": 32, "shift": 3.0}
#: the builder :func:`pipelines.tiny.build_tiny` calls
build = build_tiny_sd3
