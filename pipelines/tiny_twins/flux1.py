"""Tiny FLUX.1-dev pipeline: guidance embedding, double + single stream blocks, CLIP-L + T5 stand-ins."""

from __future__ import annotations

from typing import Any

from pipelines.tiny_twins.base import CLIP_L_STANDIN, T5_STANDIN, clip_config, merge, scalar_options, sd_vae_standin
from pipelines.tiny_twins.base import assemble, seeded, t5_config, vae_config
from pipelines.tiny_tokenizers import clip_tokenizer, t5_tokenizer



FLUX_DEFAULTS: dict[str, Any] = {
    "seed": 0,
    "clip_vocab_size": 2048,
    "clip_max_length": 77,
    "t5_max_length": 32,
    "t5_extra_words": (),
    # FLUX.1-dev-like: guidance embedding, double + single stream blocks, 3-axis RoPE
    "transformer": {
        "patch_size": 1,
        "num_layers": 1,
        "num_single_layers": 1,
        "attention_head_dim": 16,
        "num_attention_heads": 2,
        "guidance_embeds": True,
        "axes_dims_rope": [4, 6, 6],
    },
    "vae": sd_vae_standin(scaling_factor=0.3611, shift_factor=0.1159),
    "text_encoder": dict(CLIP_L_STANDIN),  # pooled output only
    "text_encoder_2": dict(T5_STANDIN),  # T5-XXL stand-in
    # FLUX.1's scheduler config: resolution-dependent (dynamic) shift
    "scheduler": {
        "num_train_timesteps": 1000,
        "shift": 3.0,
        "use_dynamic_shifting": True,
        "base_shift": 0.5,
        "max_shift": 1.15,
        "base_image_seq_len": 256,
        "max_image_seq_len": 4096,
    },
}


def build_tiny_flux(**overrides):
    """A tiny ``FluxPipeline`` (FLUX.1-dev-like: guidance embedding; CLIP-L + T5 stand-ins).

    Overrides as :func:`build_tiny_sd3` with components ``transformer``, ``vae``, ``text_encoder``
    (CLIP), ``text_encoder_2`` (T5), ``scheduler``. ``in_channels`` = 4 × VAE latent channels
    (2×2 packing), ``joint_attention_dim`` = T5 ``d_model``, ``pooled_projection_dim`` = CLIP hidden.
    The pipeline's default height is 128 × VAE factor, so pass ``height``/``width`` when calling.
    """
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    o = scalar_options("flux", FLUX_DEFAULTS, overrides)
    vae_cfg = vae_config(FLUX_DEFAULTS["vae"], overrides.get("vae"))
    tok = clip_tokenizer(o["clip_vocab_size"], o["clip_max_length"])
    tok_2 = t5_tokenizer(o["t5_max_length"], tuple(o["t5_extra_words"]))
    c1 = clip_config(merge(FLUX_DEFAULTS["text_encoder"], overrides.get("text_encoder")), tok)
    t5 = t5_config(merge(FLUX_DEFAULTS["text_encoder_2"], overrides.get("text_encoder_2")), tok_2)
    tr = merge(FLUX_DEFAULTS["transformer"], overrides.get("transformer"))
    tr.setdefault("in_channels", 4 * vae_cfg["latent_channels"])
    tr.setdefault("joint_attention_dim", t5["d_model"])
    tr.setdefault("pooled_projection_dim", c1["hidden_size"])
    tr["axes_dims_rope"] = tuple(tr["axes_dims_rope"])
    if sum(tr["axes_dims_rope"]) != tr["attention_head_dim"]:
        raise ValueError(f"transformer.axes_dims_rope {tr['axes_dims_rope']} must sum to attention_head_dim")
    sched = merge(FLUX_DEFAULTS["scheduler"], overrides.get("scheduler"))

    with seeded(o["seed"]):
        transformer = FluxTransformer2DModel(**tr)
        vae = AutoencoderKL(**vae_cfg)
        te = CLIPTextModel(CLIPTextConfig(**c1))
        te_2 = T5EncoderModel(T5Config(**t5))
    return assemble(FluxPipeline, transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(**sched), vae=vae,
                    text_encoder=te, tokenizer=tok, text_encoder_2=te_2, tokenizer_2=tok_2)


#: the sampling defaults written next to the tiny model (``flowalign.json``)
SAMPLING: dict[str, Any] = {"height": 32, "width": 32, "num_frames": None, "guidance_scale": 3.5, "num_steps": 20,
                            "max_sequence_length": 32, "shift": 3.0}
#: the builder :func:`pipelines.tiny.build_tiny` calls
build = build_tiny_flux
