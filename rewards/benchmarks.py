"""Benchmarks by name: the prompts, per-sample metadata and reward of an evaluation split.

``flowalign evaluate --bench NAME`` reaches these through :func:`load_benchmark`; the core never knows
what a VVR task is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from flowalign.errors import UserError
from rewards.registry import load as load_reward

LEVELS = ("easy", "medium", "hard")
#: the shipped splits; training tasks come from :func:`training_tasks`
SPLITS = ("validation", "test")
TRAIN = "train"


@dataclass
class Benchmark:
    name: str
    prompts: list[str]
    metadata: list[dict[str, Any]]
    reward: Any
    split: str = "test"


def _vvr(level: str, split: str, n: int | None, seed: int | None) -> Benchmark:
    from rewards.vvr import generate_tasks, load_split

    if split == TRAIN:
        tasks = generate_tasks(n or 500, seed=seed or 0, level=level)
    else:
        tasks = load_split(level, split, n, seed)
    return Benchmark(f"vvr-{level}", [t.prompt for t in tasks], [{"task": t.to_dict()} for t in tasks],
                     load_reward("vvr"), split)


def _vvr_motion(level: str, split: str, n: int | None, seed: int | None) -> Benchmark:
    from rewards.vvr_motion import generate_tasks, load_split

    if split == TRAIN:
        tasks = generate_tasks(n or 500, seed=seed or 0, level=level)
    else:
        tasks = load_split(level, split, n, seed)
    return Benchmark(f"vvr_motion-{level}", [t.prompt for t in tasks], [{"task": t.to_dict()} for t in tasks],
                     load_reward("vvr_motion"), split)


_BENCHMARKS = {"vvr": _vvr, "vvr_motion": _vvr_motion}


def load_benchmark(name: str, level: str = "easy", n: int | None = None, seed: int | None = None,
                   split: str = "test") -> Benchmark:
    """The ``split`` ("validation" | "test") of ``name``/``level``: the shipped file, or a fresh one of that
    split's distribution drawn with ``seed``."""
    if split not in SPLITS:
        raise UserError(f"unknown split {split!r} for --split / eval.split; choose one of {', '.join(SPLITS)}")
    return _load(name, level, n, seed, split)


def training_tasks(name: str, level: str = "easy", n: int | None = None, seed: int = 0) -> Benchmark:
    """``n`` (default 500) tasks as training draws them with ``seed`` (held-out compositions excluded)."""
    return _load(name, level, n, seed, TRAIN)


def _load(name: str, level: str, n: int | None, seed: int | None, split: str) -> Benchmark:
    if name not in _BENCHMARKS:
        raise UserError(f"unknown benchmark {name!r}; choose one of {', '.join(_BENCHMARKS)}")
    if level not in LEVELS:
        raise UserError(f"unknown level {level!r} for --level; choose one of {', '.join(LEVELS)}")
    if n is not None and n < 1:
        raise UserError(f"--n must be a positive number of tasks, got {n}")
    return _BENCHMARKS[name](level, split, n, seed)


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
