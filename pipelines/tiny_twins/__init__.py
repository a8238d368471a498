"""Tiny twins of today's released models, one builder module per family (see :mod:`pipelines.tiny`).

Each module has ``build(**overrides)`` returning a diffusers pipeline of the real classes with the
published configs shrunk, and ``SAMPLING`` (the ``flowalign.json`` sampling defaults written next to it).
Modules are imported on use, so ``pipelines.tiny`` can list the names without loading them.
"""

from __future__ import annotations

import importlib
from types import ModuleType

#: tiny name → builder module (under ``pipelines.tiny_twins``)
TWINS: dict[str, str] = {
    "qwen_image": "qwen_image",
    "flux2": "flux2",
    "zimage": "zimage",
    "wan22": "wan22",
    "kontext": "kontext",
    "wan_i2v": "wan_i2v",
    "qwen_image_edit": "qwen_image_edit",
}


def twin_module(name: str) -> ModuleType:
    """The builder module of the tiny twin ``name``."""
    return importlib.import_module(f"pipelines.tiny_twins.{TWINS[name]}")
