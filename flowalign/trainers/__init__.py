"""Trainers by name: ``trainer.name`` in a run config picks one (imported lazily).

A name is looked up, in order, among the built-in trainers (:data:`TRAINERS`), the entry-point group
``flowalign.trainers`` of every installed distribution (how another package adds a trainer), and as a
``package.module:Class`` path (a trainer in the user's own code, no packaging needed)::

    trainer:
      name: my_lab.trainers:MyTrainer   # a GroupTrainer subclass with its own Config
"""

from __future__ import annotations

import difflib
import importlib
from importlib.metadata import entry_points
from typing import Any

from flowalign.errors import UserError

ENTRY_POINT_GROUP = "flowalign.trainers"

TRAINERS = {
    "flow_grpo": "flowalign.trainers.flow_grpo:FlowGRPOTrainer",
    "flash_grpo": "flowalign.trainers.flash_grpo:FlashGRPOTrainer",
    "diffusion_opsd": "flowalign.trainers.diffusion_opsd:DiffusionOPSDTrainer",
    "diffusion_nft": "flowalign.trainers.diffusion_nft:DiffusionNFTTrainer",
    "soar": "flowalign.trainers.soar:SOARTrainer",
    "sft": "flowalign.trainers.soar:SFTTrainer",
    "festdpo": "flowalign.trainers.festdpo:FestDPOTrainer",
    "rg_opd": "flowalign.trainers.rg_opd:RGOPDTrainer",
    "dance_grpo": "flowalign.trainers.dance_grpo:DanceGRPOTrainer",
    "mix_grpo": "flowalign.trainers.mix_grpo:MixGRPOTrainer",
    "grpo_guard": "flowalign.trainers.grpo_guard:GRPOGuardTrainer",
    "awm": "flowalign.trainers.awm:AWMTrainer",
    "dgpo": "flowalign.trainers.dgpo:DGPOTrainer",
    "diffusion_dpo": "flowalign.trainers.diffusion_dpo:DiffusionDPOTrainer",
    "self_opd": "flowalign.trainers.self_opd:SelfOPDTrainer",
    "tempflow_grpo": "flowalign.trainers.tempflow_grpo:TempFlowGRPOTrainer",
    "pref_grpo": "flowalign.trainers.pref_grpo:PrefGRPOTrainer",
    "gardo": "flowalign.trainers.gardo:GARDOTrainer",
    "pd_grpo": "flowalign.trainers.pd_grpo:PDGRPOTrainer",
    "seppo": "flowalign.trainers.seppo:SePPOTrainer",
    "fav": "flowalign.trainers.fav:FAVTrainer",
    "flow_opd": "flowalign.trainers.flow_opd:FlowOPDTrainer",
    "ar_copo": "flowalign.trainers.ar_copo:ARCoPOTrainer",
    "kvpo": "flowalign.trainers.kvpo:KVPOTrainer",
    "afd": "flowalign.trainers.afd:AFDTrainer",
    "umm_reflection": "flowalign.trainers.umm_reflection:UMMReflectionTrainer",
}


def registered() -> dict[str, str]:
    """``name → "module:Class"`` of every trainer known by name: built-in first, then entry points
    (an entry point cannot replace a built-in name)."""
    found = dict(TRAINERS)
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        found.setdefault(ep.name, ep.value)
    return found


def get_trainer(name: str) -> type:
    """The trainer class that ``trainer.name`` names (a registered name or ``package.module:Class``)."""
    known = registered()
    target = known.get(name) or (name if ":" in name else None)
    if target is None:
        close = difflib.get_close_matches(name, list(known), n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise UserError(f"unknown trainer {name!r} (trainer.name); {hint}choose one of {', '.join(known)}, "
                        "or give 'package.module:Class'")
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise UserError(f"trainer.name={name}: cannot import {module_name!r} ({err}); check the spelling and "
                        "that it is installed") from err
    cls = getattr(module, attr, None)
    if not isinstance(cls, type) or not isinstance(getattr(cls, "Config", None), type):
        raise UserError(f"trainer.name={name}: {target!r} is not a trainer class (a GroupTrainer subclass with "
                        "a Config); see docs/guide/adding-a-trainer.md")
    return cls


def trainer_config(section: dict[str, Any]) -> tuple[type, Any]:
    """The trainer class named by a config's ``trainer`` section and the section validated by its ``Config``
    (errors name the field, with a did-you-mean for unknown keys).

    A trainer given by path or entry point declares its own short name in ``Config.name``; the section is
    validated under that name, and the user's spelling is what the resolved config keeps."""
    from flowalign.config import validate_section

    name = str(section.get("name", "flow_grpo"))
    cls = get_trainer(name)
    field = cls.Config.model_fields.get("name")
    declared = name if field is None or field.is_required() else field.default
    check_keys(cls.Config, section, declared)
    return cls, validate_section(cls.Config, {**section, "name": declared}, "trainer.")


def check_keys(config: type, section: dict[str, Any], trainer: str) -> None:
    """Refuse a key the trainer does not read, naming the trainer (its ``Config`` holds only what it reads)."""
    known = set(config.model_fields) | set(getattr(config, "renamed", {})) | set(getattr(config, "refused", {}))
    for key in section:
        if key not in known:
            close = difflib.get_close_matches(str(key), sorted(config.model_fields), n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise UserError(f"trainer.{key}: {trainer} has no such setting; {hint}its settings are listed in "
                            "docs/guide/configuration.md")
