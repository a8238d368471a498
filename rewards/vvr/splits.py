"""The shipped VVR benchmark splits, ``assets/vvr/<level>/{validation,test}.jsonl``, or fresh ones.

* ``test``: tasks that hold a held-out composition (``rewards.vvr.heldout``), which the training
  generator never produces; read once per result.
* ``validation``: tasks from the training distribution (``generate_tasks`` as training draws them) with
  their own seeds; settings are chosen on it.

Both are disjoint by construction: every test task is held out and no validation task is.
"""

from __future__ import annotations

import json
from typing import Any, Callable, TypeVar

from flowalign.errors import UserError
from flowalign.paths import assets_dir
from rewards.vvr.generate import generate_heldout_tasks, generate_tasks
from rewards.vvr.tasks import LEVELS, Task

SPLITS: tuple[str, ...] = ("validation", "test")
#: split → level → seed (≥ 1000: seeds < 1000 belong to training)
SPLIT_SEEDS: dict[str, dict[str, int]] = {
    "test": {"easy": 1001, "medium": 1002, "hard": 1003},
    "validation": {"easy": 1101, "medium": 1102, "hard": 1103},
}
SPLIT_SIZE = 500
T = TypeVar("T")


def check_split(split: str) -> str:
    """``split`` if it is a benchmark split, else a one-line ``UserError`` listing the choices."""
    if split not in SPLITS:
        raise UserError(f"unknown split {split!r} for --split / eval.split; choose one of {', '.join(SPLITS)}")
    return split


def draw_split(level: str, split: str, n: int = SPLIT_SIZE, seed: int | None = None) -> list[Task]:
    """``n`` fresh tasks of ``split``'s distribution (held-out compositions for test), drawn with
    ``seed`` (default: the shipped split's seed, which reproduces the shipped file)."""
    return draw_benchmark_split(SPLIT_SEEDS, level, split, n, seed, generate=generate_tasks,
                                generate_heldout=generate_heldout_tasks)


def draw_benchmark_split(
    seeds: dict[str, dict[str, int]],
    level: str,
    split: str,
    n: int,
    seed: int | None,
    *,
    generate: Callable[..., list[T]],
    generate_heldout: Callable[..., list[T]],
) -> list[T]:
    """``draw_split`` of a task family: ``n`` tasks from ``generate_heldout`` (test) or ``generate``
    (validation), drawn with ``seed`` (default: ``seeds[split][level]``, the shipped split's)."""
    seed = seeds[check_split(split)][level] if seed is None else seed
    if split == "test":
        return generate_heldout(n, seed=seed, level=level)
    return generate(n, seed=seed, level=level)


def load_split(level: str, split: str = "test", n: int | None = None, seed: int | None = None) -> list[Task]:
    """The first ``n`` (default all) tasks of the shipped ``level``/``split`` file, or ``n`` (default 500)
    fresh tasks of that split's distribution drawn with ``seed`` when one is given."""
    return load_benchmark_split("vvr", level, split, n, seed, draw=draw_split, from_dict=Task.from_dict)


def load_benchmark_split(
    name: str,
    level: str,
    split: str,
    n: int | None,
    seed: int | None,
    *,
    draw: Callable[[str, str, int, int], list[T]],
    from_dict: Callable[[dict[str, Any]], T],
) -> list[T]:
    """``load_split`` of the task family ``name`` (``"vvr"``, ``"vvr_motion"``): with a ``seed``,
    ``draw(level, split, n or SPLIT_SIZE, seed)``; else the first ``n`` (default all) tasks of
    ``assets/<name>/<level>/<split>.jsonl``, each built with ``from_dict``."""
    check_split(split)
    if level not in LEVELS:
        raise UserError(f"unknown level {level!r} for --level; choose one of {', '.join(LEVELS)}")
    if seed is not None:
        return draw(level, split, n or SPLIT_SIZE, seed)
    path = assets_dir() / name / level / f"{split}.jsonl"
    if not path.exists():
        raise UserError(f"benchmark split {path} is missing; regenerate it with scripts/make_{name}_splits.py"
                        " or pass --seed")
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [from_dict(d) for d in lines][: n or None]
