"""The shipped ``geneval`` splits, ``assets/geneval/{validation,test}.jsonl``, or fresh draws of them.

* ``test``: held-out compositions only (``rewards.geneval.prompts``), never drawn for training;
* ``validation``: the training distribution, drawn with its own seed.

Each line is a GenEval metadata line (``tag``, ``include``, ``exclude``, ``prompt``), so a split file is also a
valid ``data.prompts`` file and reads in GenEval's own tools.
"""

from __future__ import annotations

import json
from typing import Any

from flowalign.benchmarks import SPLITS
from flowalign.errors import UserError
from flowalign.paths import assets_dir
from rewards.geneval.prompts import generate_tasks

#: split → seed (training draws use the config's data.seed, small numbers)
SPLIT_SEEDS = {"test": 2001, "validation": 2101}
SPLIT_SIZE = 600


def draw_split(split: str, n: int = SPLIT_SIZE, seed: int | None = None) -> list[dict[str, Any]]:
    """Fresh distinct tasks of ``split``'s distribution (default seed: the shipped file's)."""
    seed = SPLIT_SEEDS[split] if seed is None else seed
    return generate_tasks(n, seed=seed, heldout="only" if split == "test" else "exclude", distinct=True)


def load_split(split: str, n: int | None = None, seed: int | None = None) -> list[dict[str, Any]]:
    """The first ``n`` (default all) tasks of the shipped split, or ``n`` fresh ones drawn with ``seed``."""
    if split not in SPLITS:
        raise UserError(f"unknown split {split!r} for --split / eval.split; choose one of {', '.join(SPLITS)}")
    if seed is not None:
        return draw_split(split, n or SPLIT_SIZE, seed)
    path = assets_dir() / "geneval" / f"{split}.jsonl"
    if not path.exists():
        raise UserError(f"benchmark split {path} is missing; regenerate it with scripts/make_geneval_splits.py"
                        " or pass --seed")
    tasks = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return tasks[: n or None]
