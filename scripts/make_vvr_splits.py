"""Write the fixed VVR benchmark splits: ``assets/vvr/{easy,medium,hard}.jsonl``.

    python scripts/make_vvr_splits.py [--n 500] [--out assets/vvr]

One ``Task.to_dict()`` per line, 500 tasks per level, generated with the fixed seeds below. Seeds
below 1000 are reserved for training and pretraining data, so benchmark tasks are never trained on.
The output is deterministic: rerunning rewrites identical files.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


from rewards.vvr import generate_tasks  # noqa: E402

#: benchmark seed per level (≥ 1000; seeds < 1000 belong to training)
SPLIT_SEEDS = {"easy": 1001, "medium": 1002, "hard": 1003}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=500, help="tasks per level")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "assets" / "vvr")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for level, seed in SPLIT_SEEDS.items():
        tasks = generate_tasks(args.n, seed=seed, level=level)
        path = args.out / f"{level}.jsonl"
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(json.dumps(t.to_dict(), sort_keys=True) + "\n" for t in tasks))
        tmp.replace(path)
        print(f"{path}: {len(tasks)} tasks (seed {seed})")


if __name__ == "__main__":
    main()
