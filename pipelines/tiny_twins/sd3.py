"""Tiny SD3 / SD3.5 pipeline: MMDiT + SD3 VAE + CLIP-L / CLIP-G / T5 stand-ins."""

from __future__ import annotations

from typing import Any

from pipelines.tiny_twins.base import check_keys, clip_config, merge, seeded, vae_blocks
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
    "vae": {
        "in_channels": 3,
        "out_channels": 3,
        "block_out_channels": [16, 32, 32],
        "layers_per_block": 1,
        "latent_channels": 4,
        "norm_num_groups": 8,
        "scaling_factor": 1.5305,
        "shift_factor": 0.0609,
        "use_quant_conv": False,
        "use_post_quant_conv": False,
        "mid_block_add_attention": True,
    },
    "text_encoder": {  # CLIP-L stand-in
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "projection_dim": 32,
        "hidden_act": "quick_gelu",
    },
    "text_encoder_2": {  # CLIP-G stand-in
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "projection_dim": 32,
        "hidden_act": "gelu",
    },
    "text_encoder_3": {  # T5-XXL stand-in; d_model >= sum of CLIP hidden sizes (SD3 pads CLIP to it)
        "d_model": 64,
        "d_kv": 16,
        "d_ff": 128,
        "num_layers": 2,
        "num_heads": 4,
        "relative_attention_num_buckets": 8,
        "relative_attention_max_distance": 32,
        "feed_forward_proj": "gated-gelu",
        "dropout_rate": 0.0,
    },
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

    check_keys("sd3", overrides, set(SD3_DEFAULTS))
    o = {k: overrides.get(k, v) for k, v in SD3_DEFAULTS.items() if not isinstance(v, dict)}
    vae_cfg = merge(SD3_DEFAULTS["vae"], overrides.get("vae"))
    vae_cfg = {**vae_blocks(vae_cfg["block_out_channels"]), **vae_cfg}
    f = 2 ** (len(vae_cfg["block_out_channels"]) - 1)
    vae_cfg.setdefault("sample_size", o["height"])

    tok = clip_tokenizer(o["clip_vocab_size"], o["clip_max_length"])
    tok_2 = clip_tokenizer(o["clip_vocab_size"], o["clip_max_length"], pad_token="!")
    tok_3 = t5_tokenizer(o["t5_max_length"], tuple(o["t5_extra_words"]))
    c1 = clip_config(merge(SD3_DEFAULTS["text_encoder"], overrides.get("text_encoder")), tok)
    c2 = clip_config(merge(SD3_DEFAULTS["text_encoder_2"], overrides.get("text_encoder_2")), tok_2)
    t5 = merge(SD3_DEFAULTS["text_encoder_3"], overrides.get("text_encoder_3"))
    t5.setdefault("vocab_size", len(tok_3))
    t5.setdefault("pad_token_id", tok_3.pad_token_id)
    t5.setdefault("eos_token_id", tok_3.eos_token_id)
    t5.setdefault("decoder_start_token_id", tok_3.pad_token_id)
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
    pipe = StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(**sched),
        vae=vae,
        text_encoder=te.eval(),
        tokenizer=tok,
        text_encoder_2=te_2.eval(),
        tokenizer_2=tok_2,
        text_encoder_3=te_3.eval(),
        tokenizer_3=tok_3,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe

