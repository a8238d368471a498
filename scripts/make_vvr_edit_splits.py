"""Write the fixed VVR editing splits: ``assets/vvr_edit/<level>/{validation,test}.jsonl``.

    python scripts/make_vvr_edit_splits.py [--n 100] [--out assets/vvr_edit]

One ``EditTask.to_dict()`` per line, ``--n`` tasks per level and split, drawn with ``heldout="only"`` (every task
acts on a composition training never sees) and the seeds ``rewards.vvr_edit.SPLIT_SEEDS``. Deterministic.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rewards.vvr_edit import SPLIT_SEEDS, generate_edit_tasks  # noqa: E402
from rewards.vvr_edit.generate import LEVELS  # noqa: E402
from rewards.vvr_edit.splits import SPLIT_SIZE  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=SPLIT_SIZE, help="tasks per level and split")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "assets" / "vvr_edit")
    args = parser.parse_args(argv)
    for level in LEVELS:
        for split, seed in SPLIT_SEEDS.items():
            tasks = generate_edit_tasks(args.n, seed=seed, level=level, heldout="only")
            path = args.out / level / f"{split}.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(json.dumps(t.to_dict(), sort_keys=True) + "\n" for t in tasks))
            tmp.replace(path)
            print(f"{path}: {len(tasks)} tasks (seed {seed})")


if __name__ == "__main__":
    main()
