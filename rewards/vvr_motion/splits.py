"""The shipped motion benchmark splits, ``assets/vvr_motion/<level>/{validation,test}.jsonl``, or fresh ones.

``test`` holds only tasks with a held-out composition (``rewards.vvr_motion.heldout``), which the
training generator never produces; ``validation`` is drawn from the training distribution with its own
seeds. Both are disjoint by construction.
"""

from __future__ import annotations

from rewards.vvr.splits import SPLITS, draw_benchmark_split, load_benchmark_split
from rewards.vvr_motion.generate import generate_heldout_tasks, generate_tasks
from rewards.vvr_motion.tasks import MotionTask

__all__ = ["SPLITS", "SPLIT_SEEDS", "SPLIT_SIZE", "draw_split", "load_split"]

#: split → level → seed (≥ 1000: seeds < 1000 belong to training; VVR's images use 1001-1103)
SPLIT_SEEDS: dict[str, dict[str, int]] = {
    "test": {"easy": 2001, "medium": 2002, "hard": 2003},
    "validation": {"easy": 2101, "medium": 2102, "hard": 2103},
}
SPLIT_SIZE = 500


def draw_split(level: str, split: str, n: int = SPLIT_SIZE, seed: int | None = None) -> list[MotionTask]:
    """``n`` fresh tasks of ``split``'s distribution drawn with ``seed`` (default: the shipped split's)."""
    return draw_benchmark_split(SPLIT_SEEDS, level, split, n, seed, generate=generate_tasks,
                                generate_heldout=generate_heldout_tasks)


def load_split(level: str, split: str = "test", n: int | None = None, seed: int | None = None) -> list[MotionTask]:
    """The first ``n`` (default all) tasks of the shipped ``level``/``split`` file, or ``n`` (default 500)
    fresh tasks of that split's distribution drawn with ``seed`` when one is given."""
    return load_benchmark_split("vvr_motion", level, split, n, seed, draw=draw_split, from_dict=MotionTask.from_dict)
