"""Benchmarks by name: the prompts, per-sample metadata and reward of an evaluation split.

``flowalign evaluate --bench NAME`` reaches these through :func:`load_benchmark`; the core never knows
what a VVR task is.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import partial
from typing import Any

from flowalign.errors import UserError
from flowalign.paths import assets_dir
from rewards.registry import load as load_reward

LEVELS = ("easy", "medium", "hard")


@dataclass
class Benchmark:
    name: str
    prompts: list[str]
    metadata: list[dict[str, Any]]
    reward: Any


def _vvr(level: str, n: int | None, seed: int | None) -> Benchmark:
    from rewards.vvr import Task, generate_tasks

    if seed is not None:  # a fresh split, not the shipped one
        tasks = generate_tasks(n or 500, seed=seed, level=level)
    else:
        path = assets_dir() / "vvr" / f"{level}.jsonl"
        if not path.exists():
            raise UserError(f"benchmark split {path} is missing; regenerate it with scripts/make_vvr_splits.py or pass --seed")
        lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        tasks = [Task.from_dict(d) for d in lines][: n or None]
    return Benchmark(f"vvr-{level}", [t.prompt for t in tasks], [{"task": t.to_dict()} for t in tasks], load_reward("vvr"))


def _vvr_motion(level: str, n: int | None, seed: int | None) -> Benchmark:
    from rewards.vvr_motion import load_split

    tasks = load_split(level, n, seed)
    return Benchmark(f"vvr_motion-{level}", [t.prompt for t in tasks], [{"task": t.to_dict()} for t in tasks],
                     load_reward("vvr_motion"))


def _vvr_edit(level: str, n: int | None, seed: int | None) -> Benchmark:
    """Editing: each prompt's metadata carries the task and its rendered source scene as the input ``image``.

    Seeds below 1000 draw training tasks (held-out compositions excluded), as ``data.bench`` passes them;
    no seed reads the shipped test split, another seed draws a fresh held-out one."""
    from rewards.vvr_edit import generate_edit_tasks, load_split, render_source

    if seed is not None and seed < 1000:
        tasks = generate_edit_tasks(n or 500, seed=seed, level=level, heldout="exclude")
    else:
        tasks = load_split(level, "test", n, seed)
    # rendered on use: thousands of training draws would otherwise hold their images in memory
    metadata = [{"task": t.to_dict(), "image": partial(render_source, t, size=EDIT_IMAGE_SIZE)} for t in tasks]
    return Benchmark(f"vvr_edit-{level}", [t.prompt for t in tasks], metadata, load_reward("vvr_edit"))


#: side of the rendered source scenes handed to editing models (they resize to their own resolution)
EDIT_IMAGE_SIZE = 256
_BENCHMARKS = {"vvr": _vvr, "vvr_motion": _vvr_motion, "vvr_edit": _vvr_edit}


def load_benchmark(name: str, level: str = "easy", n: int | None = None, seed: int | None = None) -> Benchmark:
    """The split ``name``/``level``: the shipped file, or a fresh one drawn with ``seed``."""
    if name not in _BENCHMARKS:
        raise UserError(f"unknown benchmark {name!r}; choose one of {', '.join(_BENCHMARKS)}")
    if level not in LEVELS:
        raise UserError(f"unknown level {level!r} for --level; choose one of {', '.join(LEVELS)}")
    if n is not None and n < 1:
        raise UserError(f"--n must be a positive number of tasks, got {n}")
    return _BENCHMARKS[name](level, n, seed)


def _render_vvr(metadata: dict[str, Any], size: int):
    from rewards.vvr import render

    if "task" not in metadata:
        raise UserError("a vvr training item has no 'task' in its metadata; draw tasks with data.bench: vvr")
    return render(metadata["task"], size=size)


_RENDERERS = {"vvr": _render_vvr}


def render_task(name: str, metadata: dict[str, Any], size: int):
    """The ground-truth image of one benchmark task, ``(3, size, size)`` float32 in [0, 1].

    Benchmarks whose tasks are programmatic scenes can render them, which gives real (image, caption)
    pairs for reward-free trainers (SOAR, SFT) without a dataset on disk.
    """
    import numpy as np
    import torch

    if name not in _RENDERERS:
        raise UserError(f"benchmark {name!r} cannot render its tasks to images (only {', '.join(_RENDERERS)}); "
                        "give image/caption pairs with trainer.pairs instead")
    image = np.asarray(_RENDERERS[name](metadata, size).convert("RGB"), dtype=np.float32) / 255.0
    return torch.from_numpy(image.copy()).permute(2, 0, 1)
