"""Tiny HunyuanVideo 1.5 twin: ``HunyuanVideo15Pipeline`` with every component shrunk, real classes throughout.

``HunyuanVideo15Transformer3DModel`` (dual-stream DiT over video tokens, a token refiner for the
Qwen2.5-VL text, a ByT5 glyph projection, image-embedding slots), the causal 3D
``AutoencoderKLHunyuanVideo15``, a ``Qwen2_5_VLTextModel`` with ``Qwen2Tokenizer`` (the chat template the
pipeline applies) and a ``T5EncoderModel`` with the byte-level ``ByT5Tokenizer`` (no vocabulary file).
"""

from __future__ import annotations

from typing import Any

from pipelines.tiny_twins.base import check_keys, merge, seeded
from pipelines.tiny_twins.tokenizers import SPECIALS, qwen_tokenizer

DEFAULTS: dict[str, Any] = {
    "seed": 0,
    # RoPE axes (t, h, w) sum to the head dim; the published model: 16 heads × 128, 54 layers, 2 refiner layers
    "transformer": {"num_attention_heads": 2, "attention_head_dim": 16, "num_layers": 2, "num_refiner_layers": 1,
                    "rope_axes_dim": [4, 6, 6], "image_embed_dim": 16, "target_size": 32},
    # spatial ×4, temporal ×2 (the published: ×16, ×4 over five levels)
    "vae": {"latent_channels": 4, "block_out_channels": [8, 16, 16], "layers_per_block": 1,
            "spatial_compression_ratio": 4, "temporal_compression_ratio": 2},
    # Qwen2.5-VL-7B language model stand-in (M-RoPE sections sum to head_dim / 2); 3 layers: the pipeline
    # reads the third hidden state from the end
    "text_encoder": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3, "num_attention_heads": 2,
                     "num_key_value_heads": 1, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6,
                                                                   "mrope_section": [2, 3, 3]}},
    # ByT5-small glyph encoder stand-in
    "text_encoder_2": {"d_model": 16, "d_kv": 8, "d_ff": 32, "num_layers": 1, "num_heads": 2},
    # hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_t2v scheduler: shift 5 at 480p
    "scheduler": {"num_train_timesteps": 1000, "shift": 5.0},
    "guidance_scale": 6.0,
}

#: the pipeline's defaults (50 steps; CFG 6 in the released guider config), fewer steps for the tiny model
SAMPLING: dict[str, Any] = {"height": 32, "width": 32, "num_frames": 5, "guidance_scale": 6.0, "num_steps": 20,
                            "shift": 5.0}


def text_encoder(cfg: dict[str, Any], tok):
    """A tiny ``Qwen2_5_VLTextModel`` whose special-token ids are the tokenizer's."""
    from transformers import Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel

    ids = {s: tok.convert_tokens_to_ids(s) for s in SPECIALS}
    config = Qwen2_5_VLTextConfig(**cfg, vocab_size=len(tok), bos_token_id=ids["<|endoftext|>"],
                                  eos_token_id=ids["<|im_end|>"])
    return Qwen2_5_VLTextModel(config).eval()


def build(**overrides):
    """A tiny ``HunyuanVideo15Pipeline``; ``overrides`` replace whole component configs or ``seed`` /
    ``guidance_scale``."""
    from diffusers import (AutoencoderKLHunyuanVideo15, ClassifierFreeGuidance, FlowMatchEulerDiscreteScheduler,
                           HunyuanVideo15Pipeline, HunyuanVideo15Transformer3DModel)
    from transformers import ByT5Tokenizer, T5Config, T5EncoderModel

    check_keys("hunyuan_video15", overrides, set(DEFAULTS))
    tok = qwen_tokenizer(model_max_length=2048)
    te_cfg = merge(DEFAULTS["text_encoder"], overrides.get("text_encoder"))
    t5_cfg = merge(DEFAULTS["text_encoder_2"], overrides.get("text_encoder_2"))
    tok_2 = ByT5Tokenizer()
    vae_cfg = merge(DEFAULTS["vae"], overrides.get("vae"))
    z = vae_cfg["latent_channels"]
    tr = merge(DEFAULTS["transformer"], overrides.get("transformer"))
    tr.update(in_channels=2 * z + 1, out_channels=z, text_embed_dim=te_cfg["hidden_size"],
              text_embed_2_dim=t5_cfg["d_model"], rope_axes_dim=tuple(tr["rope_axes_dim"]))
    with seeded(overrides.get("seed", DEFAULTS["seed"])):
        transformer = HunyuanVideo15Transformer3DModel(**tr)
        vae = AutoencoderKLHunyuanVideo15(**vae_cfg)
        te = text_encoder(te_cfg, tok)
        te_2 = T5EncoderModel(T5Config(**t5_cfg, vocab_size=len(tok_2), decoder_start_token_id=0)).eval()
    pipe = HunyuanVideo15Pipeline(
        text_encoder=te, tokenizer=tok, transformer=transformer, vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(**merge(DEFAULTS["scheduler"], overrides.get("scheduler"))),
        text_encoder_2=te_2, tokenizer_2=tok_2,
        guider=ClassifierFreeGuidance(guidance_scale=overrides.get("guidance_scale", DEFAULTS["guidance_scale"])),
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe
