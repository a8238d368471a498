"""Tiny FLUX.2 [klein] twin: ``Flux2KleinPipeline`` with the published klein-4B transformer config shrunk.

Real classes: ``Flux2Transformer2DModel`` (double- and single-stream blocks, fused QKV+MLP single blocks,
4-axis RoPE), ``AutoencoderKLFlux2`` (32-channel latents patchified 2×2 and batch-normalised), a
``Qwen3ForCausalLM`` text encoder whose hidden states of three layers are stacked (klein: layers 9, 18, 27
of 36; here 1, 2, 3 of 3) and ``Qwen2Tokenizer`` with Qwen3's chat template.
"""

from __future__ import annotations

from typing import Any

from pipelines.tiny_twins.published import published_config
from pipelines.tiny_twins.tokenizers import qwen_tokenizer

DEFAULTS: dict[str, Any] = {
    "seed": 0,
    "is_distilled": False,  # klein base (CFG); the distilled klein samples in 4 steps without CFG
    "transformer": {"num_layers": 1, "num_single_layers": 1, "attention_head_dim": 16, "num_attention_heads": 2,
                    "timestep_guidance_channels": 32, "axes_dims_rope": [4, 4, 4, 4]},
    "vae": {"block_out_channels": [16, 32, 32], "layers_per_block": 1, "latent_channels": 4, "norm_num_groups": 8},
    "text_encoder": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3, "num_attention_heads": 2,
                     "num_key_value_heads": 1, "head_dim": 16, "max_position_embeddings": 512},
    # black-forest-labs/FLUX.2 scheduler_config.json: exponential dynamic shift (mu from compute_empirical_mu)
    "scheduler": {"base_image_seq_len": 256, "base_shift": 0.5, "max_image_seq_len": 4096, "max_shift": 1.15,
                  "num_train_timesteps": 1000, "shift": 3.0, "time_shift_type": "exponential",
                  "use_dynamic_shifting": True},
}

#: klein base: CFG 4.0, 50 steps (model card); the three stacked text layers of the tiny encoder
SAMPLING: dict[str, Any] = {"height": 32, "width": 32, "num_frames": None, "guidance_scale": 4.0, "num_steps": 20,
                            "max_sequence_length": 32, "text_encoder_out_layers": [1, 2, 3]}


def build(**overrides):
    """A tiny ``Flux2KleinPipeline``; its VAE carries non-trivial batch-norm statistics (as trained ones)."""
    import torch
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline
    from diffusers import Flux2Transformer2DModel
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from pipelines.tiny_twins.base import check_keys, merge, seeded, vae_config

    check_keys("flux2", overrides, set(DEFAULTS))
    tok = qwen_tokenizer()
    te_cfg = merge(DEFAULTS["text_encoder"], overrides.get("text_encoder"))
    vae_cfg = vae_config(DEFAULTS["vae"], overrides.get("vae"))
    tr = {**published_config("flux2_klein_4b"), **merge(DEFAULTS["transformer"], overrides.get("transformer"))}
    tr.update(in_channels=4 * vae_cfg["latent_channels"], joint_attention_dim=3 * te_cfg["hidden_size"])
    with seeded(overrides.get("seed", DEFAULTS["seed"])):
        transformer = Flux2Transformer2DModel(**tr)
        vae = AutoencoderKLFlux2(**vae_cfg)
        channels = vae.bn.running_mean.numel()
        vae.bn.running_mean.copy_(0.1 * torch.randn(channels))
        vae.bn.running_var.copy_(0.5 + torch.rand(channels))
        te = Qwen3ForCausalLM(Qwen3Config(**te_cfg, vocab_size=len(tok), bos_token_id=None,
                                          eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)).eval()
    pipe = Flux2KleinPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**merge(DEFAULTS["scheduler"], overrides.get("scheduler"))),
        vae=vae, text_encoder=te, tokenizer=tok, transformer=transformer,
        is_distilled=bool(overrides.get("is_distilled", DEFAULTS["is_distilled"])),
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe
