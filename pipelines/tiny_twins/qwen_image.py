"""Tiny Qwen-Image twin: ``QwenImagePipeline`` with the published transformer config shrunk.

Real classes throughout: ``QwenImageTransformer2DModel`` (MMDiT, 3-axis scaled RoPE), the single-frame
causal 3D ``AutoencoderKLQwenImage`` with per-channel latent mean/std, a ``Qwen2_5_VLForConditionalGeneration``
text encoder (language model + vision tower, as the release) and ``Qwen2Tokenizer``.
"""

from __future__ import annotations

from typing import Any

from pipelines.tiny_twins.published import published_config
from pipelines.tiny_twins.tokenizers import SPECIALS, qwen_tokenizer

DEFAULTS: dict[str, Any] = {
    "seed": 0,
    # the published config with widths and depth shrunk; RoPE axes sum to the head dim
    "transformer": {"num_layers": 2, "attention_head_dim": 16, "num_attention_heads": 2, "axes_dims_rope": [4, 6, 6]},
    "vae": {"base_dim": 8, "z_dim": 4, "dim_mult": [1, 2, 2], "num_res_blocks": 1, "attn_scales": [],
            "temperal_downsample": [False, True]},
    # Qwen2.5-VL-7B-Instruct stand-in: M-RoPE sections sum to head_dim / 2
    "text_encoder": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                     "num_key_value_heads": 1, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6,
                                                                   "mrope_section": [2, 3, 3]}},
    "vision": {"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "fullatt_block_indexes": [0]},
    # Qwen/Qwen-Image scheduler/scheduler_config.json
    "scheduler": {"base_image_seq_len": 256, "base_shift": 0.5, "max_image_seq_len": 8192, "max_shift": 0.9,
                  "num_train_timesteps": 1000, "shift": 1.0, "shift_terminal": 0.02, "time_shift_type": "exponential",
                  "use_dynamic_shifting": True},
}

#: Qwen-Image's recommended sampling (model card): true CFG 4.0 with the negative prompt " ", 50 steps
SAMPLING: dict[str, Any] = {"height": 32, "width": 32, "num_frames": None, "guidance_scale": 4.0, "num_steps": 20,
                            "max_sequence_length": 64, "negative_prompt": " "}


def text_encoder(cfg: dict[str, Any], vision: dict[str, Any], tok):
    """A tiny ``Qwen2_5_VLForConditionalGeneration`` whose special-token ids are the tokenizer's."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    ids = {s: tok.convert_tokens_to_ids(s) for s in SPECIALS}
    text = {**cfg, "vocab_size": len(tok), "bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"]}
    config = Qwen2_5_VLConfig(
        text_config=text,
        vision_config={**vision, "out_hidden_size": cfg["hidden_size"]},
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )
    return Qwen2_5_VLForConditionalGeneration(config).eval()


def build(pipeline_class: Any = None, **overrides):
    """A tiny ``QwenImagePipeline`` (or ``pipeline_class``, e.g. ``QwenImageEditPipeline``, same components)."""
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImagePipeline
    from diffusers import QwenImageTransformer2DModel

    from pipelines.tiny_twins.base import check_keys, merge, seeded

    check_keys("qwen_image", overrides, set(DEFAULTS))
    tok = qwen_tokenizer()
    te_cfg = merge(DEFAULTS["text_encoder"], overrides.get("text_encoder"))
    vae_cfg = merge(DEFAULTS["vae"], overrides.get("vae"))
    z = vae_cfg["z_dim"]
    vae_cfg.setdefault("latents_mean", [0.1 * (i % 3) for i in range(z)])
    vae_cfg.setdefault("latents_std", [1.0 + 0.25 * (i % 2) for i in range(z)])
    tr = {**published_config("qwen_image"), **merge(DEFAULTS["transformer"], overrides.get("transformer"))}
    tr.update(in_channels=4 * z, out_channels=z, joint_attention_dim=te_cfg["hidden_size"])
    with seeded(overrides.get("seed", DEFAULTS["seed"])):
        transformer = QwenImageTransformer2DModel(**tr)
        vae = AutoencoderKLQwenImage(**vae_cfg)
        te = text_encoder(te_cfg, merge(DEFAULTS["vision"], overrides.get("vision")), tok)
    cls = pipeline_class or QwenImagePipeline
    pipe = cls(
        scheduler=FlowMatchEulerDiscreteScheduler(**merge(DEFAULTS["scheduler"], overrides.get("scheduler"))),
        vae=vae, text_encoder=te, tokenizer=tok, transformer=transformer,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe
