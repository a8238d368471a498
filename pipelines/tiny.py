"""Architecture-faithful tiny pipelines of every family, built offline from small configs.

Every component is the real diffusers / transformers class with a tiny config, so a tiny pipeline exercises
exactly the code paths of the released model and its saved folder opens with plain
``<PipelineClass>.from_pretrained(folder)``. Nothing is downloaded. One builder module per family in
:mod:`pipelines.tiny_twins` (SD3.5, FLUX.1-dev, Wan 2.1 and the newer twins: Qwen-Image, Qwen-Image-Edit,
FLUX.2 klein, Z-Image, Wan 2.2-A14B, Wan 2.2 I2V, FLUX.1 Kontext); offline CLIP / T5 tokenizers in
:mod:`pipelines.tiny_tokenizers`, Qwen ones in :mod:`pipelines.tiny_twins.tokenizers`.

Builders take nested overrides per component, e.g.
``build_tiny_sd3(transformer={"num_layers": 4}, scheduler={"shift": 1.0}, height=64)``, and are
deterministic: weights are initialised under ``torch.manual_seed(seed)`` inside a forked RNG, so
the caller's global RNG state is left untouched.

``save_tiny(family, out_dir)`` writes the diffusers folder (safetensors) plus ``flowalign.json`` with
the sampling defaults that ``pipelines.load()`` reads (:func:`write_sampling_defaults`).
"""

from __future__ import annotations

import importlib
import json
import os
from pathlib import Path
from types import ModuleType
from typing import Any

from flowalign import families
from pipelines.tiny_tokenizers import clip_tokenizer, t5_tokenizer
from pipelines.tiny_twins.flux1 import FLUX_DEFAULTS, build_tiny_flux
from pipelines.tiny_twins.sd3 import SD3_DEFAULTS, build_tiny_sd3
from pipelines.tiny_twins.wan import WAN_DEFAULTS, build_tiny_wan

__all__ = [
    "twins",
    "build_tiny",
    "build_tiny_sd3",
    "build_tiny_flux",
    "build_tiny_wan",
    "save_tiny",
    "pipeline_bytes",
    "sampling_defaults",
    "write_sampling_defaults",
    "read_sampling_defaults",
    "clip_tokenizer",
    "t5_tokenizer",
    "SAMPLING_DEFAULTS_FILE",
    "SD3_DEFAULTS",
    "FLUX_DEFAULTS",
    "WAN_DEFAULTS",
]

SAMPLING_DEFAULTS_FILE = "flowalign.json"


def twins() -> dict[str, str]:
    """Tiny model name → its builder module, over every registered family (:mod:`flowalign.families`)."""
    return {name: module for spec in families.registry().values() for name, module in spec.tiny.items()}


def twin_module(name: str) -> ModuleType:
    """The builder module of the tiny model ``name``: ``build(**overrides)`` and ``SAMPLING``."""
    known = twins()
    if name not in known:
        raise ValueError(f"family={name!r}: expected one of {list(known)}")
    return importlib.import_module(known[name])


def build_tiny(family: str, **overrides):
    """Build the tiny pipeline ``family`` (a name of :func:`twins`; one per family and variant)."""
    return twin_module(family).build(**overrides)


def sampling_defaults(family: str) -> dict[str, Any]:
    """The ``flowalign.json`` defaults of the tiny model ``family`` (a copy)."""
    return dict(twin_module(family).SAMPLING)


def pipeline_bytes(pipe: Any) -> int:
    """The bytes of every tensor of ``pipe``'s model components: about what its saved weights take."""
    from flowalign.disk_space import tensor_bytes

    modules = [c for c in pipe.components.values() if hasattr(c, "state_dict")]
    return sum(tensor_bytes(m.state_dict().values()) for m in modules)


def write_sampling_defaults(out_dir: str | os.PathLike, **defaults: Any) -> Path:
    """Write ``flowalign.json`` (sampling defaults that ``pipelines.load()`` reads) into ``out_dir``.

    Typical keys: ``family``, ``height``, ``width``, ``num_frames`` (None for images),
    ``guidance_scale``, ``num_steps``, ``max_sequence_length``, ``shift``. Written atomically.
    """
    from flowalign.io import atomic_path

    path = Path(out_dir) / SAMPLING_DEFAULTS_FILE
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(defaults, indent=2) + "\n")
    return path


def read_sampling_defaults(folder: str | os.PathLike) -> dict[str, Any] | None:
    """The ``flowalign.json`` of a model folder, or None when absent."""
    path = Path(folder) / SAMPLING_DEFAULTS_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def save_tiny(family: str, out_dir: str | os.PathLike, *, sampling: dict[str, Any] | None = None, pipe: Any = None,
              overwrite: bool = False, **overrides):
    """Build a tiny ``family`` pipeline (or take ``pipe``, built by :func:`build_tiny` with ``overrides``),
    save it as a diffusers folder (safetensors) plus ``flowalign.json``; returns the pipeline. ``sampling``
    updates the family's sampling defaults. The folder is written atomically (:func:`flowalign.io.atomic_dir`,
    writer ``save-tiny``): a failure leaves ``out_dir`` as it was, and a folder holding files it did not write
    is refused unless ``overwrite``. Inside ``flowalign tiny``'s own atomic folder it writes straight into it."""
    from flowalign.io import atomic_dir

    pipe = build_tiny(family, **overrides) if pipe is None else pipe
    defaults = {"family": family, **sampling_defaults(family)}
    if "height" in overrides:  # a builder that takes the image side (SD3, FLUX.1) samples at it
        defaults["height"] = defaults["width"] = overrides["height"]
    defaults["shift"] = float(pipe.scheduler.config.shift)
    defaults.update(sampling or {})
    with atomic_dir(out_dir, writer="save-tiny", overwrite=overwrite) as tmp:
        pipe.save_pretrained(tmp, safe_serialization=True)
        write_sampling_defaults(tmp, **defaults)
    return pipe

