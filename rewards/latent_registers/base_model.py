"""The base model a latent reward reads latents through: its diffusers folder found, and its transformer loaded
alone and frozen (the reward's own copy, never the policy's)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from flowalign.errors import UserError
from flowalign.paths import REPO_ROOT
from rewards.latent_registers import flux, sd3, wan

CONFIG_NAME = "config.json"
#: the transformer classes latent rewards know how to read
#: Z-Image's transformer (its registers are the grid_pool architecture alone: ``zimage_grid``)
ZIMAGE_CLASS_NAME = "ZImageTransformer2DModel"
SUPPORTED = (sd3.CLASS_NAME, flux.CLASS_NAME, wan.CLASS_NAME, ZIMAGE_CLASS_NAME)


def resolve_base_model(path: str | None, directory: Path) -> Path:
    if not path:
        raise UserError(f"{directory / CONFIG_NAME} names no base_model; pass the transformer to load() explicitly")
    p = Path(path)
    if not p.exists() and not p.is_absolute() and (REPO_ROOT / p).exists():
        p = REPO_ROOT / p
    if not (p / "transformer").is_dir():
        raise UserError(f"base_model {path!r} of {directory} has no transformer/ folder; fix base_model in "
                        f"{directory / CONFIG_NAME} to the diffusers folder the registers were trained on")
    return p


def load_frozen_transformer(path: str | None, directory: Path, device: str | torch.device = "cpu",
                            dtype: torch.dtype | None = None) -> nn.Module:
    """The base model's transformer alone, frozen: the reward's own copy, so a policy that trains its
    transformer (LoRA or full) never moves the reward. The class is the one the folder's
    ``transformer/config.json`` names (SD3, FLUX, Wan or Z-Image)."""
    import diffusers

    folder = resolve_base_model(path, directory)
    try:
        kind = json.loads((folder / "transformer" / "config.json").read_text())["_class_name"]
    except (OSError, ValueError, KeyError) as err:
        raise UserError(f"{folder / 'transformer' / 'config.json'} does not name its transformer class ({err})") from err
    if kind not in SUPPORTED:
        raise UserError(f"base_model {path!r} has a {kind}; latent registers support {', '.join(SUPPORTED)}")
    model = getattr(diffusers, kind).from_pretrained(str(folder), subfolder="transformer", torch_dtype=dtype or torch.float32)
    return model.to(device).requires_grad_(False).eval()
