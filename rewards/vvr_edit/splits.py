"""The shipped ``vvr_edit`` splits: ``assets/vvr_edit/<level>/{validation,test}.jsonl`` (held-out compositions).

Written by ``scripts/make_vvr_edit_splits.py`` from :func:`generate_edit_tasks` with ``heldout="only"`` and the
seeds in :data:`SPLIT_SEEDS`; a split read with another ``seed`` is drawn fresh from the same distribution.
Input images are not stored: :func:`rewards.vvr_edit.render_source` draws them from the scene.
"""

from __future__ import annotations

import json

from flowalign.errors import UserError
from flowalign.paths import assets_dir
from rewards.vvr_edit.generate import generate_edit_tasks
from rewards.vvr_edit.tasks import EditTask

SPLIT_SEEDS = {"validation": 1001, "test": 1002}
SPLIT_SIZE = 100


def load_split(level: str, split: str = "test", n: int | None = None, seed: int | None = None) -> list[EditTask]:
    """The first ``n`` tasks of the shipped ``split`` of ``level``, or ``n`` fresh held-out ones drawn with ``seed``."""
    if split not in SPLIT_SEEDS:
        raise UserError(f"vvr_edit split {split!r} is unknown; choose one of {', '.join(SPLIT_SEEDS)}")
    if seed is not None:
        return generate_edit_tasks(n or SPLIT_SIZE, seed=seed, level=level, heldout="only")
    path = assets_dir() / "vvr_edit" / level / f"{split}.jsonl"
    if not path.is_file():
        raise UserError(f"benchmark split {path} is missing; regenerate it with scripts/make_vvr_edit_splits.py")
    tasks = [EditTask.from_dict(json.loads(line)) for line in path.read_text().splitlines() if line.strip()]
    return tasks[: n or None]
