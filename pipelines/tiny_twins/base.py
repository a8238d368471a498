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


def clip_config(cfg: dict[str, Any], tok) -> dict[str, Any]:
    cfg = dict(cfg)
    cfg.setdefault("vocab_size", len(tok))
    cfg.setdefault("max_position_embeddings", tok.model_max_length)
    cfg.setdefault("bos_token_id", tok.bos_token_id)
    cfg.setdefault("eos_token_id", tok.eos_token_id)
    cfg.setdefault("pad_token_id", tok.pad_token_id)
    return cfg

