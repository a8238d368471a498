"""The options every model reward takes for its weights: ``path``, ``device``, ``dtype``, ``batch_size``.

One way to give weights, whatever the reward: ``path`` is a local folder or file, exactly what the model's
card offers for download; nothing is fetched at run time. ``device`` defaults to the samples' device,
``dtype`` is the model's compute dtype (inputs and scores stay float32), ``batch_size`` the images per
forward pass. A reward calls :func:`weights_path` for each weight option it takes (one clear line when it is
unset or does not exist) and :func:`deprecated` for an old option name it still accepts.

>>> folder = weights_path("pickscore", path, download="yuvalkirstain/PickScore_v1 (the model folder)")
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from flowalign.errors import UserError

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16,
}


def one_of(label: str, option: str, value: Any, choices: Iterable[str],
           meanings: Mapping[str, str] | None = None) -> None:
    """Nothing when ``value`` is one of ``choices``; else one line naming the owner (``label``, e.g. ``"hps
    reward"``), the option and each choice, with what it means where ``meanings`` says so."""
    choices = list(choices)
    if value in choices:
        return
    meanings = meanings or {}
    listed = ", ".join(f"{c} ({meanings[c]})" if c in meanings else c for c in choices)
    raise UserError(f"{label}: {option}={value!r} is not known; use one of {listed}")


def weights_path(who: str, path: str | Path | None, *, download: str, option: str = "path",
                 kind: str = "any", label: str | None = None) -> Path:
    """``path`` as a :class:`~pathlib.Path` that exists, else one line naming the reward, the option and
    what to download. ``kind``: ``"folder"``, ``"file"`` or ``"any"`` (either). ``label``: how the line
    names its owner (default ``"<who> reward"``; an image encoder names itself)."""
    label = label or f"{who} reward"
    noun = {"folder": "folder", "file": "file"}.get(kind, "folder or file")
    fix = f"download {download} and set {option}: to the downloaded {noun}"
    if path is None or str(path) == "":
        raise UserError(f"{label}: {option} is not set; {fix}")
    p = Path(path).expanduser()
    if not p.exists():
        raise UserError(f"{label}: {option}={str(path)!r} does not exist; {fix}")
    if kind == "folder" and not p.is_dir():
        raise UserError(f"{label}: {option}={str(path)!r} is a file; give the folder of {download}")
    if kind == "file" and not p.is_file():
        raise UserError(f"{label}: {option}={str(path)!r} is a folder; give the file {download}")
    return p


def deprecated(who: str, old: str, new: str) -> None:
    """One line on stderr: ``old`` still works, ``new`` is the option to use."""
    print(f"warning: {who} reward: option {old!r} is deprecated; use {new} instead", file=sys.stderr)


def resolve_dtype(dtype: str | torch.dtype, who: str) -> torch.dtype:
    """``"fp32"``/``"bf16"``/``"fp16"`` (or their long names, or a ``torch.dtype``) → ``torch.dtype``."""
    if isinstance(dtype, torch.dtype) and dtype in _DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype.lower() in _DTYPES:
        return _DTYPES[dtype.lower()]
    raise UserError(f"{who} reward: dtype={dtype!r} is not supported; use one of {sorted(_DTYPES)}")


def resolve_batch_size(batch_size: object, who: str) -> int:
    """A positive ``int`` (YAML's ``true`` is refused: it is an int in Python)."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise UserError(f"{who} reward: batch_size must be a positive integer, got {batch_size!r}")
    return batch_size


def resolve_device(device: str | torch.device | None, who: str) -> torch.device | None:
    """``None`` (the samples' device, decided per call) or a ``torch.device``."""
    if device is None:
        return None
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise UserError(f"{who} reward: device={device!r} is not a device ({e}); use e.g. 'cuda:0' or 'cpu'") from None


def compute_device(device: torch.device | None, samples: torch.Tensor) -> torch.device:
    """Where a reward runs: its ``device`` option, else the samples' device."""
    return device if device is not None else samples.device
