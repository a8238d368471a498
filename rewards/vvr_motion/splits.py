"""The shipped motion benchmark splits: ``assets/vvr_motion/{easy,medium,hard}.jsonl``, or fresh ones."""

from __future__ import annotations

import json

from flowalign.errors import UserError
from flowalign.paths import assets_dir
from rewards.vvr_motion.generate import generate_tasks
from rewards.vvr_motion.tasks import MotionTask

#: benchmark seed per level (≥ 1000: seeds < 1000 belong to training; VVR's images use 1001-1003)
SPLIT_SEEDS: dict[str, int] = {"easy": 2001, "medium": 2002, "hard": 2003}
SPLIT_SIZE = 500


def load_split(level: str, n: int | None = None, seed: int | None = None) -> list[MotionTask]:
    """The first ``n`` (default all) tasks of the shipped ``level`` split, or ``n`` (default 500) fresh
    tasks drawn with ``seed`` when one is given."""
    if seed is not None:
        return generate_tasks(n or SPLIT_SIZE, seed=seed, level=level)
    path = assets_dir() / "vvr_motion" / f"{level}.jsonl"
    if not path.exists():
        raise UserError(f"benchmark split {path} is missing; regenerate it with scripts/make_vvr_motion_splits.py"
                        " or pass --seed")
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [MotionTask.from_dict(d) for d in lines][: n or None]
