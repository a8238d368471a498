"""A stage-2 trainer's teachers as tensors: read from their adapters or run folders into the live policy's
trained tensors, and merged into one starting point (Flow-OPD, ``docs/methods/flow_opd.md``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from flowalign.errors import UserError
from flowalign.paths import REPO_ROOT
from flowalign.saved_weights import load_adapter_checked


def merged_tensor(tensors: list[torch.Tensor], mode: str, weights: list[float] | None = None) -> torch.Tensor:
    """One trained tensor of the teachers merged as the authors' ``scripts/merge.py`` merges a LoRA key: the
    elementwise mean ("average"), sum ("sum"), or the sum weighted by ``weights / sum(weights)`` ("weighted").
    A LoRA's A and B are merged each on its own, so the merged update is mean(B)·mean(A), not mean(B·A)."""
    stacked = torch.stack(tensors)
    if mode == "average":
        return stacked.mean(0)
    if mode == "sum":
        return stacked.sum(0)
    w = torch.tensor(weights, dtype=torch.float32)
    w = w / w.sum()
    return sum(t * wi for t, wi in zip(tensors, w))


def merge_into(named: dict[str, torch.nn.Parameter], teachers: list[dict[str, torch.Tensor]], mode: str,
               weights: list[float] | None = None) -> None:
    """Each trained tensor of ``named`` overwritten by the teachers' ones merged (:func:`merged_tensor`)."""
    with torch.no_grad():
        for n, p in named.items():
            p.copy_(merged_tensor([t[n] for t in teachers], mode, weights))


def check_merge(mode: str | None, weights: list[float] | None, count: int) -> None:
    """Refuse ``trainer.merge_weights`` without ``trainer.merge_teachers: weighted`` (and the reverse), and weights
    that are not one per teacher (``count`` of them, each ≥ 0 by its bound) with a positive sum."""
    if (mode == "weighted") != (weights is not None):
        raise UserError("trainer.merge_weights goes with trainer.merge_teachers: weighted (one weight per teacher); "
                        "give both or neither")
    if weights is not None and (len(weights) != count or sum(weights) <= 0):
        raise UserError(f"trainer.merge_weights={weights}: give {count} weights ≥ 0, one per teacher in list order, "
                        "with a positive sum")


def read_weights(policy: Any, named: dict[str, torch.nn.Parameter], folder: str,
                 source: str = "trainer.teachers") -> dict[str, torch.Tensor]:
    """A teacher's trainable tensors by name: its checkpoint loaded into the live policy, copied out, and the
    live weights put back (``source``: the config field that named ``folder``, for errors)."""
    live = {n: p.detach().clone() for n, p in named.items()}
    try:
        load_adapter_checked(policy, teacher_checkpoint(Path(folder)), source)
        return {n: p.detach().clone() for n, p in named.items()}
    finally:
        with torch.no_grad():
            for n, p in named.items():
                p.copy_(live[n])


def teacher_checkpoint(path: Path) -> Path:
    """A run folder's newest checkpoint that verifies; any other folder as it is. (Checked here, when training
    starts, not with the config: ``flowalign plan`` and ``--check`` of a stage-2 run work before stage 1.)
    A relative path that is not found from here is read from the repository, as configs name shipped assets."""
    if not path.exists() and not path.is_absolute() and (REPO_ROOT / path).exists():
        path = REPO_ROOT / path
    if not path.exists():
        raise UserError(f"trainer.teachers: adapter {str(path)!r} does not exist; train the teacher first (stage 1) "
                        "and give its run folder or checkpoint, e.g. runs/<name>/checkpoints/step-N")
    if not (path / "checkpoints").is_dir():
        return path
    from flowalign.checkpoint_manifest import resume_folder

    newest = resume_folder(path, "auto", main=False)
    if newest is None:
        raise UserError(f"trainer.teachers: the run {path} has no whole checkpoint yet; train it (stage 1) first")
    return newest
