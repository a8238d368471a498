"""Config helpers shared by the tiny builders: merge overrides, a forked seeded RNG, key checks."""

from __future__ import annotations

import copy
from typing import Any

import torch


def merge(base: dict[str, Any], over: dict[str, Any] | None) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for k, v in (over or {}).items():
        out[k] = v
    return out


class seeded:
    """Fork the global torch RNG, seed it, restore it on exit."""

    def __init__(self, seed: int):
        self.seed = seed

    def __enter__(self):
        self._ctx = torch.random.fork_rng(devices=[])
        self._ctx.__enter__()
        torch.manual_seed(self.seed)

    def __exit__(self, *exc):
        return self._ctx.__exit__(*exc)


def check_keys(family: str, overrides: dict[str, Any], allowed: set[str]) -> None:
    bad = sorted(set(overrides) - allowed)
    if bad:
        raise TypeError(f"build_tiny_{family}: unknown override(s) {bad}; allowed: {sorted(allowed)}")


def vae_blocks(block_out_channels) -> dict[str, Any]:
    n = len(block_out_channels)
    return {
        "down_block_types": ["DownEncoderBlock2D"] * n,
        "up_block_types": ["UpDecoderBlock2D"] * n,
        "block_out_channels": list(block_out_channels),
    }


def vae_config(base: dict[str, Any], over: dict[str, Any] | None) -> dict[str, Any]:
    """An ``AutoencoderKL`` config: ``over`` merged into ``base``, block types filled in per channel level."""
    cfg = merge(base, over)
    return {**vae_blocks(cfg["block_out_channels"]), **cfg}


def with_defaults(cfg: dict[str, Any], **values: Any) -> dict[str, Any]:
    """A copy of ``cfg`` with ``values`` filled in where ``cfg`` has none (derived fields an override may set)."""
    return {**cfg, **{k: v for k, v in values.items() if k not in cfg}}


def clip_config(cfg: dict[str, Any], tok) -> dict[str, Any]:
    """A CLIP stand-in config with the vocabulary, length and token ids of ``tok`` filled in unless given."""
    return with_defaults(cfg, vocab_size=len(tok), max_position_embeddings=tok.model_max_length,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)



def t5_config(cfg: dict[str, Any], tok) -> dict[str, Any]:
    """A T5 / UMT5 stand-in config with the token ids and vocabulary of ``tok`` filled in unless given."""
    return with_defaults(cfg, vocab_size=len(tok), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                         decoder_start_token_id=tok.pad_token_id)


def scalar_options(family: str, defaults: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """The builder's non-component options (seed, lengths, ...) over ``defaults``; unknown keys refused."""
    check_keys(family, overrides, set(defaults))
    return {k: overrides.get(k, v) for k, v in defaults.items() if not isinstance(v, dict)}


#: T5-XXL / UMT5-XXL stand-in: a 2-layer gated-GELU encoder of width 32
T5_STANDIN: dict[str, Any] = {
    "d_model": 32,
    "d_kv": 8,
    "d_ff": 64,
    "num_layers": 2,
    "num_heads": 4,
    "relative_attention_num_buckets": 8,
    "relative_attention_max_distance": 32,
    "feed_forward_proj": "gated-gelu",
    "dropout_rate": 0.0,
}

#: CLIP-L stand-in (FLUX.1 and SD3 take its pooled output)
CLIP_L_STANDIN: dict[str, Any] = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "projection_dim": 32,
    "hidden_act": "quick_gelu",
}


def sd_vae_standin(scaling_factor: float, shift_factor: float) -> dict[str, Any]:
    """The FLUX.1 / SD3-style ``AutoencoderKL`` stand-in (f = 4, 4 latent channels, no quant convs) with the
    checkpoint's latent ``scaling_factor`` and ``shift_factor``."""
    return {
        "in_channels": 3,
        "out_channels": 3,
        "block_out_channels": [16, 32, 32],
        "layers_per_block": 1,
        "latent_channels": 4,
        "norm_num_groups": 8,
        "scaling_factor": scaling_factor,
        "shift_factor": shift_factor,
        "use_quant_conv": False,
        "use_post_quant_conv": False,
        "mid_block_add_attention": True,
    }


def assemble(pipeline_class: type, **components: Any) -> Any:
    """``pipeline_class(**components)`` as ``from_pretrained`` gives a pipeline: its text encoders in eval mode,
    the progress bar off."""
    pipe = pipeline_class(**{k: v.eval() if k.startswith("text_encoder") else v for k, v in components.items()})
    pipe.set_progress_bar_config(disable=True)
    return pipe
