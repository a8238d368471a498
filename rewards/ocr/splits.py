"""The shipped OCR benchmark splits, ``assets/ocr/<level>/{validation,test}.jsonl``, or fresh ones.

As VVR's (:mod:`rewards.vvr.splits`, whose loaders this reuses): ``test`` holds only prompts with a
held-out (template, word) pair, ``validation`` is drawn from the training distribution with its own seeds.
"""

from __future__ import annotations

from rewards.ocr.prompts import OCRTask, generate_heldout_tasks, generate_tasks
from rewards.vvr.splits import SPLIT_SIZE, draw_benchmark_split, load_benchmark_split

#: split → level → seed (≥ 1000: seeds < 1000 belong to training)
SPLIT_SEEDS: dict[str, dict[str, int]] = {
    "test": {"easy": 2001, "medium": 2002, "hard": 2003},
    "validation": {"easy": 2101, "medium": 2102, "hard": 2103},
}


def draw_split(level: str, split: str, n: int = SPLIT_SIZE, seed: int | None = None) -> list[OCRTask]:
    """``n`` fresh prompts of ``split``'s distribution drawn with ``seed`` (default: the shipped file's)."""
    return draw_benchmark_split(SPLIT_SEEDS, level, split, n, seed, generate=generate_tasks,
                                generate_heldout=generate_heldout_tasks)


def load_split(level: str, split: str = "test", n: int | None = None, seed: int | None = None) -> list[OCRTask]:
    """The first ``n`` (default all) prompts of the shipped ``level``/``split`` file, or ``n`` (default 500)
    fresh ones drawn with ``seed`` when one is given."""
    return load_benchmark_split("ocr", level, split, n, seed, draw=draw_split, from_dict=OCRTask.from_dict)
