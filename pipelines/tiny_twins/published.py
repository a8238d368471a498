"""Published transformer configs of the released checkpoints, and their parameter counts on the meta device.

The values are the ``transformer/config.json`` of each release on the Hugging Face Hub. Where a release
ships under ``assets/architectures/`` (what ``flowalign plan`` sizes), its config is read from there, so the
two never differ; the others are written out here. The tiny twins start from these and shrink only the
widths and depths, so every architectural switch (guidance embedding, qk-norm, RoPE axes, cross-attention
norm, ...) stays as released. :func:`count_parameters` instantiates a config under ``torch.device("meta")``
(no memory) to check that a config really is the published size.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from flowalign.paths import REPO_ROOT

#: where the shipped architectures' configs live
ARCHITECTURES = REPO_ROOT / "assets" / "architectures"

#: name → (its config: a component folder under :data:`ARCHITECTURES`, or the config with its
#: ``_class_name``; the published size in parameters)
PUBLISHED: dict[str, tuple[str | dict[str, Any], float]] = {
    # Qwen/Qwen-Image: 60 MMDiT blocks, Qwen2.5-VL-7B text features (3584)
    "qwen_image": ("qwen-image/transformer", 20e9),
    # black-forest-labs/FLUX.2-dev: 8 double + 48 single blocks, Mistral-Small-3.1 features (3 × 5120)
    "flux2_dev": ("flux.2-dev/transformer", 32e9),
    # black-forest-labs/FLUX.2-klein-4B: 5 double + 20 single blocks, Qwen3-4B features (3 × 2560)
    "flux2_klein_4b": ("flux.2-klein/transformer", 4e9),
    # Tongyi-MAI/Z-Image-Turbo: 30 single-stream blocks (+2 noise / 2 context refiners), Qwen3-4B features
    "zimage": ("z-image-turbo/transformer", 6e9),
    # Wan-AI/Wan2.2-T2V-A14B-Diffusers: each of transformer / transformer_2
    "wan22_a14b_expert": ("wan2.2-a14b/transformer", 14e9),
    # black-forest-labs/FLUX.2-klein-9B: 8 double + 24 single blocks, Qwen3-8B features (3 × 4096)
    "flux2_klein_9b": ({"_class_name": "Flux2Transformer2DModel",
        "patch_size": 1, "in_channels": 128, "num_layers": 8, "num_single_layers": 24, "attention_head_dim": 128,
        "num_attention_heads": 32, "joint_attention_dim": 12288, "timestep_guidance_channels": 256,
        "mlp_ratio": 3.0, "axes_dims_rope": [32, 32, 32, 32], "rope_theta": 2000, "guidance_embeds": False}, 9e9),
    # Wan-AI/Wan2.2-I2V-A14B-Diffusers: each expert; input = latent + 4 mask channels + first-frame latent
    "wan22_i2v_a14b_expert": ({"_class_name": "WanTransformer3DModel",
        "patch_size": [1, 2, 2], "num_attention_heads": 40, "attention_head_dim": 128, "in_channels": 36,
        "out_channels": 16, "text_dim": 4096, "freq_dim": 256, "ffn_dim": 13824, "num_layers": 40,
        "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads", "eps": 1e-6, "rope_max_seq_len": 1024}, 14e9),
    # Wan-AI/Wan2.2-TI2V-5B-Diffusers: one transformer over the 48-channel Wan 2.2 VAE
    "wan22_ti2v_5b": ({"_class_name": "WanTransformer3DModel",
        "patch_size": [1, 2, 2], "num_attention_heads": 24, "attention_head_dim": 128, "in_channels": 48,
        "out_channels": 48, "text_dim": 4096, "freq_dim": 256, "ffn_dim": 14336, "num_layers": 30,
        "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads", "eps": 1e-6, "rope_max_seq_len": 1024}, 5e9),
}


def published_class(name: str) -> str:
    """The diffusers transformer class of the published config ``name`` (a key of :data:`PUBLISHED`)."""
    return _config(name)["_class_name"]


def published_config(name: str) -> dict[str, Any]:
    """A copy of the published transformer config ``name`` (a key of :data:`PUBLISHED`), without the
    ``_``-prefixed bookkeeping keys: the transformer's constructor arguments."""
    return {k: v for k, v in _config(name).items() if not k.startswith("_")}


def _config(name: str) -> dict[str, Any]:
    source = PUBLISHED[name][0]
    if isinstance(source, str):
        return json.loads((ARCHITECTURES / source / "config.json").read_text())
    return dict(source)


def count_parameters(class_name: str, config: dict[str, Any]) -> int:
    """Parameters of ``diffusers.<class_name>(**config)``, built on the meta device (no memory)."""
    import diffusers

    with torch.device("meta"):
        model = getattr(diffusers, class_name)(**config)
    return sum(p.numel() for p in model.parameters())
