"""Trainers by name: ``trainer.name`` in a run config picks one (imported lazily)."""

from __future__ import annotations

import importlib

from flowalign.errors import UserError

TRAINERS = {
    "flow_grpo": "flowalign.trainers.flow_grpo:FlowGRPOTrainer",
    "flash_grpo": "flowalign.trainers.flash_grpo:FlashGRPOTrainer",
    "diffusion_opsd": "flowalign.trainers.diffusion_opsd:DiffusionOPSDTrainer",
    "diffusion_nft": "flowalign.trainers.diffusion_nft:DiffusionNFTTrainer",
    "soar": "flowalign.trainers.soar:SOARTrainer",
    "sft": "flowalign.trainers.soar:SFTTrainer",
    "festdpo": "flowalign.trainers.festdpo:FestDPOTrainer",
    "rg_opd": "flowalign.trainers.rg_opd:RGOPDTrainer",
}


def get_trainer(name: str) -> type:
    if name not in TRAINERS:
        raise UserError(f"unknown trainer {name!r} (trainer.name); choose one of {', '.join(TRAINERS)}")
    module, _, attr = TRAINERS[name].partition(":")
    return getattr(importlib.import_module(module), attr)
