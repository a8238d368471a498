"""Tiny Z-Image twin: ``ZImagePipeline`` with the published Z-Image transformer config shrunk.

Real classes: ``ZImageTransformer2DModel`` (single-stream DiT over the concatenated image and caption tokens,
with noise and context refiner blocks and 3-axis RoPE), the FLUX.1-style ``AutoencoderKL``, a ``Qwen3Model``
text encoder (its second-to-last hidden state) and ``Qwen2Tokenizer`` with Qwen3's chat template.
"""

from __future__ import annotations

from typing import Any

from pipelines.tiny_twins.published import published_config
from pipelines.tiny_twins.tokenizers import qwen_tokenizer

DEFAULTS: dict[str, Any] = {
    "seed": 0,
    # RoPE axes sum to the head dim (32 / 2 heads = 16)
    "transformer": {"dim": 32, "n_layers": 2, "n_refiner_layers": 1, "n_heads": 2, "n_kv_heads": 2,
                    "axes_dims": [4, 6, 6], "axes_lens": [256, 64, 64]},
    "vae": {"in_channels": 3, "out_channels": 3, "block_out_channels": [16, 32, 32], "layers_per_block": 1,
            "latent_channels": 4, "norm_num_groups": 8, "scaling_factor": 0.3611, "shift_factor": 0.1159,
            "use_quant_conv": False, "use_post_quant_conv": False, "mid_block_add_attention": True},
    "text_encoder": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                     "num_key_value_heads": 1, "head_dim": 16, "max_position_embeddings": 512},
    # Tongyi-MAI/Z-Image-Turbo scheduler_config.json: static shift 3
    "scheduler": {"num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": False},
}

#: CFG exercised in the tiny model (Z-Image-Turbo itself samples 8 steps without CFG: guidance_scale 1 here)
SAMPLING: dict[str, Any] = {"height": 32, "width": 32, "num_frames": None, "guidance_scale": 4.0, "num_steps": 20,
                            "max_sequence_length": 32}


def build(**overrides):
    """A tiny ``ZImagePipeline``."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel
    from transformers import Qwen3Config, Qwen3Model

    from pipelines.tiny_twins.base import check_keys, merge, seeded, vae_config

    check_keys("zimage", overrides, set(DEFAULTS))
    tok = qwen_tokenizer()
    te_cfg = merge(DEFAULTS["text_encoder"], overrides.get("text_encoder"))
    vae_cfg = vae_config(DEFAULTS["vae"], overrides.get("vae"))
    tr = {**published_config("zimage"), **merge(DEFAULTS["transformer"], overrides.get("transformer"))}
    tr.update(in_channels=vae_cfg["latent_channels"], cap_feat_dim=te_cfg["hidden_size"])
    with seeded(overrides.get("seed", DEFAULTS["seed"])):
        transformer = ZImageTransformer2DModel(**tr)
        vae = AutoencoderKL(**vae_cfg)
        te = Qwen3Model(Qwen3Config(**te_cfg, vocab_size=len(tok), bos_token_id=None,
                                    eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)).eval()
    pipe = ZImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**merge(DEFAULTS["scheduler"], overrides.get("scheduler"))),
        vae=vae, text_encoder=te, tokenizer=tok, transformer=transformer,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe
