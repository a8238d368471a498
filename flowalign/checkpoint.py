"""Checkpoints: ``checkpoints/step-XXXXXX/`` written to a temporary folder, then renamed.

A folder holds the adapter where diffusers' ``load_lora_weights`` reads it (``pytorch_lora_weights.safetensors``;
full fine-tunes save ``trainable.safetensors`` instead), the exact trainable tensors for resuming, the
optimiser, the EMA, every rank's RNG states and ``trainer_state.json``. All tensors are safetensors;
``manifest.json`` (every file's size and SHA-256, :mod:`flowalign.manifest`) and ``COMPLETE``
are written last, so a folder without them (a kill mid-write) or that no longer matches its manifest (a
damaged disk, a truncated copy) is never resumed from.
"""

from __future__ import annotations

import json
import random
import re
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from flowalign.io import fsync_dir, fsync_tree, plain_file_modes, write_json
from flowalign.manifest import write_manifest

STEP_DIR = re.compile(r"^step-(\d{6})$")
COMPLETE = "COMPLETE"


def step_dir_name(step: int) -> str:
    return f"step-{step:06d}"


def checkpoint_step(folder: Path) -> int:
    """The training step a checkpoint folder (``step-000200``) was saved at."""
    return int(STEP_DIR.match(Path(folder).name).group(1))


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first."""
    folder = Path(run_dir) / "checkpoints"
    if not folder.is_dir():
        return []
    found = [p for p in folder.iterdir() if STEP_DIR.match(p.name) and (p / COMPLETE).exists()]
    return sorted(found, key=lambda p: int(STEP_DIR.match(p.name).group(1)))


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def optimizer_to_tensors(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Split an optimiser state dict into safetensors-able tensors and JSON-able rest."""
    state = optimizer.state_dict()
    tensors, scalars = {}, {}
    for idx, entry in state["state"].items():
        for key, value in entry.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{idx}.{key}"] = value.detach().cpu().contiguous()
            else:
                scalars[f"{idx}.{key}"] = value
    return tensors, {"param_groups": state["param_groups"], "scalars": scalars}


def optimizer_from_tensors(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> dict[str, Any]:
    state: dict[int, dict[str, Any]] = {}
    for name, value in list(tensors.items()) + list(meta["scalars"].items()):
        idx, _, key = name.partition(".")
        state.setdefault(int(idx), {})[key] = value
    return {"state": state, "param_groups": meta["param_groups"]}


def rng_state() -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    tensors = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"cuda.{i}"] = s
    np_state = np.random.get_state()
    meta = {"python": random.getstate(), "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]]}
    return tensors, meta


def restore_rng_state(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    torch.set_rng_state(tensors["torch"])
    if torch.cuda.is_available():
        states = [tensors[k] for k in sorted(k for k in tensors if k.startswith("cuda."))]
        if states:
            torch.cuda.set_rng_state_all(states)
    py = meta["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    n = meta["numpy"]
    np.random.set_state((n[0], np.array(n[1], dtype=np.uint32), *n[2:]))


def save_rank_rng(folder: Path, rank: int) -> None:
    tensors, meta = rng_state()
    save_file(tensors, str(folder / f"rng-rank{rank}.safetensors"))
    (folder / f"rng-rank{rank}.json").write_text(json.dumps(meta))


def load_rank_rng(folder: Path, rank: int) -> None:
    path = folder / f"rng-rank{rank}.safetensors"
    if path.exists():  # a run resumed on fewer/more ranks keeps its fresh RNG
        restore_rng_state(load_file(str(path)), json.loads((folder / f"rng-rank{rank}.json").read_text()))


def write_checkpoint_files(
    folder: Path,
    *,
    trainable: dict[str, torch.Tensor],
    optimizer: torch.optim.Optimizer | None,
    ema_state: dict[str, torch.Tensor] | None,
    trainer_state: dict[str, Any],
) -> None:
    """Rank-0 part of a checkpoint (the adapter itself is written by the policy's ``save_adapter``).

    ``optimizer`` None: its state was written elsewhere (sharded, ``optimizer/``, by every rank).
    """
    save_file({k: v.detach().cpu().contiguous() for k, v in trainable.items()}, str(folder / "trainable.safetensors"))
    if optimizer is not None:
        opt_tensors, opt_meta = optimizer_to_tensors(optimizer)
        save_file(opt_tensors, str(folder / "optimizer.safetensors"))
        write_json(folder / "optimizer.json", opt_meta)
    if ema_state is not None:
        save_file({k: v.detach().cpu().contiguous() for k, v in ema_state.items()}, str(folder / "ema.safetensors"))
    write_json(folder / "trainer_state.json", trainer_state)


def finalise(tmp: Path, final: Path) -> None:
    """Record the manifest (sizes, checksums), mark complete, flush to the disk and move into place in one
    rename."""
    plain_file_modes(tmp)  # safetensors writes 0600; the JSON beside follows the umask
    write_manifest(tmp, skip={COMPLETE})
    (tmp / COMPLETE).write_text("ok\n")
    fsync_tree(tmp)  # a power cut after the rename must not find the step's files empty
    if final.exists():  # the same step saved again (the final save): swap by renames, the old one deleted last
        old = final.with_name(f".tmp-old-{final.name}")  # pruned like any temporary folder if a kill strands it
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
        tmp.rename(final)
        fsync_dir(final.parent)
        shutil.rmtree(old, ignore_errors=True)
        return
    tmp.rename(final)
    fsync_dir(final.parent)


def prune(run_dir: str | Path, keep: int) -> None:
    """Delete all but the newest ``keep`` complete checkpoints, and leftover temporary folders."""
    folder = Path(run_dir) / "checkpoints"
    for stale in folder.glob(".tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    for old in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


#: keys of ``trainable.safetensors`` under this prefix are trainer state kept beside the weights for resume
#: (DiffusionNFT/OPSD's behaviour weights φ), not weights that a model loads
TRAINER_STATE_PREFIX = "behaviour."


def weight_names(keys: Iterable[str]) -> list[str]:
    """The keys of ``trainable.safetensors`` that are model weights (trainer state left out)."""
    return [k for k in keys if not k.startswith(TRAINER_STATE_PREFIX)]


def ema_by_name(folder: Path, module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A checkpoint's EMA weights keyed by parameter name.

    ``ema.safetensors`` holds ``shadow.i`` in the order of the trainer's parameters: ``module``'s
    ``named_parameters()`` walk restricted to the trained ones, whose names are ``trainable.safetensors``'
    keys. The same walk over the same model pairs them again; a mismatch raises ``ValueError``.
    """
    from safetensors import safe_open

    with safe_open(str(folder / "trainable.safetensors"), "pt") as f:
        trained = set(weight_names(f.keys()))
    names = [n for n, _ in module.named_parameters() if n in trained]
    shadow = load_file(str(folder / "ema.safetensors"))
    count = sum(1 for k in shadow if k.startswith("shadow."))
    if len(names) != len(trained) or count != len(names):
        raise ValueError(f"{folder} holds {count} EMA tensors for {len(trained)} trained weights, but the model has "
                         f"{len(names)} of them")
    return {n: shadow[f"shadow.{i}"] for i, n in enumerate(names)}


def load_checkpoint(folder: Path) -> dict[str, Any]:
    """Read everything rank-independent from a complete checkpoint folder."""
    out: dict[str, Any] = {
        "trainable": load_file(str(folder / "trainable.safetensors")),
        # None when the optimiser state is sharded (``optimizer/``, read by flowalign.parallel)
        "optimizer": optimizer_from_tensors(
            load_file(str(folder / "optimizer.safetensors")), json.loads((folder / "optimizer.json").read_text())
        ) if (folder / "optimizer.safetensors").exists() else None,
        "trainer_state": json.loads((folder / "trainer_state.json").read_text()),
        "ema": load_file(str(folder / "ema.safetensors")) if (folder / "ema.safetensors").exists() else None,
    }
    return out
