"""The model-family registry: every family describes itself in one :class:`FamilySpec`, and the core reads
only these specs (``config`` checks ``model.family`` against them, ``plan`` sizes a run from them, ``tiny``
lists their builders, ``pipelines.load`` detects a folder's family through them).

Specs come from the plugin tables of :mod:`flowalign.plugins` (kind ``families``): the ``PLUGINS`` table of
the built-in ``pipelines`` package, and the entry-point group ``flowalign.families`` of any installed
distribution, each naming ``"package.module:SPEC"``. A family in another package therefore needs no edit
here or in ``pipelines``: declare a spec, point an entry point at it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flowalign.errors import UserError
from flowalign.plugins import load_target, targets

#: how a family guides: no guidance input, classifier-free (the batch runs twice), true CFG against a
#: negative prompt (twice as well), or the scale fed to the transformer as an embedding (once)
CFG_KINDS = ("none", "cfg", "true_cfg", "embedded")
#: the keys of :attr:`FamilySpec.size`
SIZE_KEYS = ("height", "width", "num_frames", "max_sequence_length")


@dataclass(frozen=True)
class FamilySpec:
    """What the core knows of one model family (declared as ``SPEC`` in the family's file).

    ``policy``: the :class:`flowalign.protocols.FlowPolicy` class, built as ``policy(path, **options)``;
    ``policy_for``: when one family serves several folder layouts, ``model_index.json`` → the class for it.
    ``pipelines``: the diffusers pipeline classes it serves (``model_index.json``'s ``_class_name``);
    ``transformers``: their transformer classes. ``lora_targets``: the LoRA's default target modules.
    ``size``: the published default ``height``, ``width``, ``num_frames`` (None for images) and
    ``max_sequence_length``; ``num_steps`` and ``guidance`` the published sampling defaults.
    ``cfg``: one of :data:`CFG_KINDS`, or a function of the transformer's config and the folder's
    ``model_index.json`` giving one (a family whose checkpoints differ). ``transformer_inputs(config, batch, size, device=, dtype=)``: the transformer's
    keyword inputs for ``batch`` samples at ``size``, as the policy passes them (what ``flowalign plan`` runs
    on the meta device). ``tiny``: tiny twin name → module with ``build(**overrides)`` and ``SAMPLING``
    (the ``flowalign.json`` defaults). ``architectures``: folders under ``assets/architectures/`` holding the
    published configs (no weights), for planning without a download. ``trained``: the folder's components
    the policy trains, of those the folder has (e.g. both experts of a two-expert model). ``decode_batch``:
    samples the policy decodes at once when ``model.decode_batch_size`` is unset; ``vae_float32``: whether
    the policy loads its VAE in float32 whatever ``model.dtype`` (both sized by ``flowalign plan``).
    ``unified``: ``"package.module:function"`` making the family's policy a
    :class:`flowalign.protocols.UnifiedPolicy` (one model that writes about its images and revises them), or
    None for a family that cannot write.
    """

    name: str
    policy: Callable[..., Any]
    pipelines: tuple[str, ...]
    transformers: tuple[str, ...]
    lora_targets: tuple[str, ...]
    size: Mapping[str, Any]
    num_steps: int
    guidance: float
    cfg: str | Callable[[Any, dict[str, Any]], str]
    transformer_inputs: Callable[..., dict[str, Any]]
    tiny: Mapping[str, str] = field(default_factory=dict)
    architectures: tuple[str, ...] = ()
    policy_for: Callable[[dict[str, Any]], Callable[..., Any]] | None = None
    trained: tuple[str, ...] = ("transformer",)
    decode_batch: int = 8
    vae_float32: bool = False
    unified: str | None = None

    def __post_init__(self) -> None:
        missing = [k for k in SIZE_KEYS if k not in self.size]
        if missing:
            raise ValueError(f"family {self.name}: size needs {', '.join(missing)}")
        if isinstance(self.cfg, str) and self.cfg not in CFG_KINDS:
            raise ValueError(f"family {self.name}: cfg={self.cfg!r}; use one of {', '.join(CFG_KINDS)}")

    @property
    def is_video(self) -> bool:
        return self.size["num_frames"] is not None

    def guidance_kind(self, transformer_config: Any, index: dict[str, Any]) -> str:
        """The :data:`CFG_KINDS` entry of a checkpoint with this transformer config and ``model_index.json``."""
        return self.cfg(transformer_config, index) if callable(self.cfg) else self.cfg

    def policy_class(self, index: dict[str, Any]) -> Callable[..., Any]:
        """The policy class for a folder whose ``model_index.json`` is ``index``."""
        return self.policy_for(index) if self.policy_for is not None else self.policy


def registry() -> dict[str, FamilySpec]:
    """``name → spec`` of every registered family (built-in first, then entry points)."""
    specs = {}
    for name, target in targets("families").items():
        spec = load_target(target)
        if not isinstance(spec, FamilySpec):
            raise UserError(f"family {name!r}: {target!r} is a {type(spec).__name__}, not a flowalign.families.FamilySpec")
        if spec.name != name:
            raise UserError(f"family {name!r}: {target!r} declares the name {spec.name!r}; register it as {spec.name!r}")
        specs[name] = spec
    return specs


def names() -> list[str]:
    """The registered family names, sorted (reads the tables only: no family module is imported)."""
    return sorted(targets("families"))


def get(name: str, field_name: str = "family") -> FamilySpec:
    """The spec of ``name``, or one line naming the registered families."""
    known = targets("families")
    if name not in known:
        raise UserError(f"{field_name}={name!r} is unknown: known families are {', '.join(sorted(known))}")
    return registry()[name]


def read_index(folder: str | Path) -> dict[str, Any]:
    """``model_index.json`` of a diffusers folder, or one line saying what is wrong with the folder."""
    folder = Path(folder)
    if not folder.exists():
        raise UserError(f"path {str(folder)!r} does not exist: pass a diffusers pipeline folder")
    if not folder.is_dir():
        raise UserError(f"path {str(folder)!r} is a file: pass a diffusers pipeline folder (with model_index.json)")
    index = folder / "model_index.json"
    if not index.is_file():
        raise UserError(
            f"path {str(folder)!r} is not a diffusers folder (no model_index.json): pass the folder that "
            "save_pretrained wrote (a downloaded model repository, or one that flowalign tiny wrote)"
        )
    try:
        data = json.loads(index.read_text())
    except json.JSONDecodeError as err:
        raise UserError(f"{index} is not valid JSON ({err}): re-download or re-save the model") from err
    if not isinstance(data, dict):
        raise UserError(f"{index} holds no mapping: re-download or re-save the model")
    return data


def detect(folder: str | Path) -> FamilySpec:
    """The spec of the family serving ``folder``'s pipeline class (``model_index.json``'s ``_class_name``)."""
    class_name = read_index(folder).get("_class_name")
    specs = registry()
    for spec in specs.values():
        if class_name in spec.pipelines:
            return spec
    known = ", ".join(f"{c} ({s.name})" for s in specs.values() for c in s.pipelines)
    raise UserError(f"family of {str(folder)!r} is unknown: model_index.json names {class_name!r}; known pipelines: {known}")
