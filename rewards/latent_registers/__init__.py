"""Latent Reward Registers (``docs/methods/latent_registers.md``): the reward module, its files, and one file per DiT
family saying how the register stream passes that family's blocks (``sd3.py``, ``flux.py``, ``wan.py``)."""

from rewards.latent_registers.registers import (
    CLASS_PATH,
    DEFAULT_HEAD,
    FAMILIES,
    LatentRegisters,
    encode_images,
    family_options_for,
    load_frozen_transformer,
    read_config,
    resolve_base_model,
    resolve_layers,
)

__all__ = ["CLASS_PATH", "DEFAULT_HEAD", "FAMILIES", "LatentRegisters", "encode_images", "family_options_for", "load_frozen_transformer", "read_config",
           "resolve_base_model", "resolve_layers"]
