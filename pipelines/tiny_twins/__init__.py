"""Tiny builders, one module per family (see :mod:`pipelines.tiny`).

``sd3``, ``flux1`` and ``wan`` hold the original ``build_tiny_*`` builders; the twins of :data:`TWINS` each
have ``build(**overrides)`` returning a diffusers pipeline of the real classes with the published configs
(:mod:`pipelines.tiny_twins.published`) shrunk, and ``SAMPLING`` (the ``flowalign.json`` defaults written next
to it). Twin modules are imported on use, so ``pipelines.tiny`` can list their names without loading them.
"""

from __future__ import annotations

import importlib
from types import ModuleType

#: tiny name → builder module (under ``pipelines.tiny_twins``)
TWINS: dict[str, str] = {
    "qwen_image": "qwen_image",
    "flux2": "flux2",
    "flux2_dev": "flux2_dev",
    "zimage": "zimage",
    "wan22": "wan22",
    "kontext": "kontext",
    "wan_i2v": "wan_i2v",
    "qwen_image_edit": "qwen_image_edit",
}


def twin_module(name: str) -> ModuleType:
    """The builder module of the tiny twin ``name``."""
    return importlib.import_module(f"pipelines.tiny_twins.{TWINS[name]}")
