"""Benchmarks by name: the prompts, per-sample metadata and reward of an evaluation split.

``flowalign evaluate --bench NAME``, ``data.bench`` and ``eval.bench`` reach a benchmark through
:func:`load_benchmark`; the core never knows what a VVR task is. A benchmark is a loader
``(level, split, n, seed) -> Benchmark`` registered under the plugin kind ``benchmarks``; one whose reward
takes options (e.g. the weights folders of a model reward) also accepts ``reward_options`` (a dict,
``eval.reward_options`` / ``evaluate --reward-option``)
(:mod:`flowalign.plugins`); one whose tasks are programmatic scenes may also register a renderer
``(metadata, size) -> PIL image`` under ``renderers``, which gives reward-free trainers (SOAR, SFT)
real (image, caption) pairs without a dataset on disk. A video benchmark's renderer returns its clip as a
uint8 array ``(F, H, W, 3)``.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from flowalign.errors import UserError
from flowalign.plugins import load_target, targets

if TYPE_CHECKING:
    import torch


@dataclass
class Benchmark:
    """One split: ``prompts[i]`` with ``metadata[i]`` (e.g. ``{"task": {...}}``), scored by ``reward``."""

    name: str
    prompts: list[str]
    metadata: list[dict[str, Any]]
    reward: Any
    split: str = "test"


#: the shipped evaluation splits: choices are made on ``validation``, ``test`` is read once per result
SPLITS = ("validation", "test")
#: what a loader is asked for to draw training tasks (held-out test compositions excluded)
TRAIN = "train"


def scored_by(reward: str, options: Callable[[dict[str, Any]], dict[str, Any]] | None = None
              ) -> Callable[[Callable[..., Benchmark]], Callable[..., Benchmark]]:
    """Decorator: the loader's evaluation splits score with the registered reward ``reward``, built with
    ``options(reward_options)`` (default: the reward options as given), which ``flowalign plan`` sizes
    (:func:`benchmark_reward`)."""

    def mark(loader: Callable[..., Benchmark]) -> Callable[..., Benchmark]:
        loader.scored_by = (reward, options or dict)  # type: ignore[attr-defined]
        return loader

    return mark


def benchmark_reward(name: str, reward_options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]] | None:
    """The reward (name and options) an evaluation split of benchmark ``name`` scores with, as its loader
    declares it (:func:`scored_by`); None where it declares none, or ``name`` is no benchmark."""
    known = targets("benchmarks")
    declared = getattr(load_target(known[name]), "scored_by", None) if name in known else None
    if declared is None:
        return None
    reward, options = declared
    return reward, options(dict(reward_options or {}))


def available_benchmarks() -> list[str]:
    return sorted(targets("benchmarks"))


def load_benchmark(name: str, level: str = "easy", n: int | None = None, seed: int | None = None,
                   split: str = "test", reward_options: dict[str, Any] | None = None) -> Benchmark:
    """The ``split`` ("validation" | "test") of ``name``/``level``: the shipped file, or a fresh one of that
    split's distribution drawn with ``seed``; ``reward_options`` go to the benchmark's reward."""
    if split not in SPLITS:
        raise UserError(f"unknown split {split!r} for --split / eval.split; choose one of {', '.join(SPLITS)}")
    return _load(name, level, n, seed, split, reward_options)


def training_tasks(name: str, level: str = "easy", n: int | None = None, seed: int = 0) -> Benchmark:
    """``n`` (default 500) tasks as training draws them with ``seed`` (held-out compositions excluded)."""
    return _load(name, level, n, seed, TRAIN)


def _load(name: str, level: str, n: int | None, seed: int | None, split: str,
          reward_options: dict[str, Any] | None = None) -> Benchmark:
    known = targets("benchmarks")
    if name not in known:
        raise UserError(f"unknown benchmark {name!r}; choose one of {', '.join(sorted(known))}")
    if n is not None and n < 1:
        raise UserError(f"--n must be a positive number of tasks, got {n}")
    loader = load_target(known[name])
    if not reward_options:
        return loader(level, split, n, seed)
    if "reward_options" not in inspect.signature(loader).parameters:
        raise UserError(f"benchmark {name!r} takes no reward options (got {', '.join(sorted(reward_options))}); "
                        "drop --reward-option / eval.reward_options")
    return loader(level, split, n, seed, reward_options=dict(reward_options))


def render_task(name: str, metadata: dict[str, Any], size: int) -> torch.Tensor:
    """The ground truth of one task of benchmark ``name``, float32 in [0, 1]: an image ``(3, size, size)``
    or a clip ``(F, 3, size, size)``."""
    import numpy as np
    import torch  # here, not at the top: listing the benchmarks (``evaluate --help``) needs no torch

    known = targets("renderers")
    if name not in known:
        raise UserError(f"benchmark {name!r} cannot render its tasks (only {', '.join(sorted(known))}); "
                        "give image/caption pairs with trainer.pairs instead")
    rendered = load_target(known[name])(metadata, size)
    pixels = np.asarray(rendered if isinstance(rendered, np.ndarray) else rendered.convert("RGB"), dtype=np.float32)
    return torch.from_numpy(pixels / 255.0).movedim(-1, -3).contiguous()
