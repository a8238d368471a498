"""Where the core finds what the other packages contribute: CLI commands, benchmarks, task renderers,
model families, image feature encoders.

The core never imports a submodule of ``rewards`` or ``pipelines``. Each kind of contribution is a table
``name → "package.module:attr"`` (or ``"package.module"`` for a whole module), read from two places and
imported only when that name is used:

- the entry-point group ``flowalign.<kind>`` of every installed distribution (how a third-party package
  adds a benchmark or a command, the same mechanism as ``flowalign.rewards``);
- ``PLUGINS[<kind>]`` of the built-in top-level packages ``rewards`` and ``pipelines`` (the same targets
  that pyproject.toml declares as entry points, so a source checkout works before it is installed again).

Kinds: ``commands`` (:mod:`flowalign.cli.main`), ``benchmarks`` and ``renderers``
(:mod:`flowalign.benchmarks`), ``families`` (:mod:`flowalign.families`: model-family specs), ``encoders``
(:func:`load_encoder`: frozen image feature encoders, e.g. GARDO's ``trainer.diversity_encoder``).
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points
from typing import Any

from flowalign.errors import UserError

#: the repository's own packages whose ``PLUGINS`` tables the core reads
BUILTIN_PACKAGES = ("rewards", "pipelines")
KINDS = ("commands", "benchmarks", "renderers", "families", "encoders")


def builtin_targets(kind: str) -> dict[str, str]:
    """``name → target`` from the ``PLUGINS`` tables of the built-in packages."""
    found: dict[str, str] = {}
    for package in BUILTIN_PACKAGES:
        table = getattr(importlib.import_module(package), "PLUGINS", {})
        found.update(table.get(kind, {}))
    return found


def builtin_target(kind: str, name: str) -> str | None:
    """The built-in target of ``name``, importing only the packages up to the one that has it."""
    for package in BUILTIN_PACKAGES:
        table = getattr(importlib.import_module(package), "PLUGINS", {})
        if name in table.get(kind, {}):
            return table[kind][name]
    return None


def targets(kind: str) -> dict[str, str]:
    """``name → target`` of every contribution of ``kind``: built-in ones first, then entry points
    (an installed package may add names; a built-in name that an entry point repeats keeps its target)."""
    if kind not in KINDS:
        raise ValueError(f"unknown plugin kind {kind!r}; known: {', '.join(KINDS)}")
    found = builtin_targets(kind)
    for ep in entry_points(group=f"flowalign.{kind}"):
        found.setdefault(ep.name, ep.value)
    return found


def load_target(target: str) -> Any:
    """Import ``"package.module"`` (the module) or ``"package.module:attr"`` (the attribute)."""
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise UserError(f"cannot import {module_name!r} for {target!r} ({err}); check that it is installed") from err
    if not attr:
        return module
    if not hasattr(module, attr):
        raise UserError(f"{target!r}: module {module_name!r} has no attribute {attr!r}")
    return getattr(module, attr)


def load_reward(spec: str, **options: Any) -> Any:
    """The reward ``spec`` from the reward registry (``rewards.load``: a name, ``module:attr`` or entry point)."""
    import rewards

    return rewards.load(spec, **options)


def reward_former_forms(spec: str) -> tuple[dict[str, Any], dict[str, tuple[str, tuple[Any, ...]]], dict[str, Any]]:
    """``(before, before_when, defaults)`` of the options of the reward ``spec`` whose default changed
    (``rewards.former_forms``; empty for a plug-in path or a name the registry does not know)."""
    import rewards

    return rewards.former_forms(spec)


def planned_reward_bytes(spec: str, options: dict[str, Any]) -> int:
    """Bytes the reward ``spec`` built with ``options`` holds on one process's device, as it states them without
    loading anything (``rewards.planned_bytes``; :class:`flowalign.protocols.SizedReward`). Raises
    :class:`flowalign.protocols.NotSized` where it cannot say."""
    import rewards

    return rewards.planned_bytes(spec, options)


def planned_encoder_bytes(name: str, path: str | None, **options: Any) -> int:
    """Bytes the image encoder ``name`` (an ``encoders`` name) of the local folder ``path`` holds, as its class's
    ``planned_bytes(path, dtype=..., **options)`` states them from its config on the meta device. Raises
    :class:`flowalign.protocols.NotSized` where it cannot say (an encoder class without ``planned_bytes``, a
    folder that does not exist)."""
    from flowalign.protocols import NotSized

    known = targets("encoders")
    if name not in known:
        raise NotSized(f"{name!r} is not a known image encoder")
    sized = getattr(load_target(known[name]), "planned_bytes", None)
    if not callable(sized):
        raise NotSized("the encoder does not state its size: give its class a planned_bytes(path, dtype, ...) classmethod")
    return int(sized(path, **options))


def differentiable_rewards() -> list[str]:
    """Names of the registered rewards that pass gradients to the samples."""
    import rewards

    return rewards.differentiable()


def load_encoder(name: str, path: str | None, *, setting: str, **options: Any) -> Any:
    """The image feature encoder ``name`` (an ``encoders`` name such as ``dinov3``) built from the local folder
    ``path``: an object whose ``encode_images`` maps ``(B, 3, H, W)`` images in [0, 1] to unit features
    ``(B, D)`` and whose ``model`` is the frozen module. ``setting`` names the config section in the one-line
    errors (an unknown name; a missing or wrong folder names ``<setting>.path``); ``options`` are the
    encoder's own (``dtype``, ...)."""
    known = targets("encoders")
    if name not in known:
        raise UserError(f"{setting}.name={name!r} is not a known image encoder; known: {', '.join(sorted(known))}")
    return load_target(known[name])(path, who=f"{name} encoder", option=f"{setting}.path", **options)
