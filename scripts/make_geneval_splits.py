"""Write the fixed GenEval-style splits: ``assets/geneval/{validation,test}.jsonl``.

    python scripts/make_geneval_splits.py [--n 600] [--out assets/geneval]

One GenEval metadata line per task, drawn with the fixed seeds ``rewards.geneval.splits.SPLIT_SEEDS``:
``test`` holds only held-out compositions, ``validation`` the training distribution. Deterministic:
rerunning rewrites identical files.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from flowalign.io import atomic_path
from rewards.geneval.splits import SPLIT_SEEDS, SPLIT_SIZE, draw_split


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=SPLIT_SIZE, help="tasks per split (at most; see the test split)")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "assets" / "geneval")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for split in SPLIT_SEEDS:
        tasks = draw_split(split, args.n)
        path = args.out / f"{split}.jsonl"
        with atomic_path(path) as tmp:
            tmp.write_text("".join(json.dumps(t) + "\n" for t in tasks))
        print(f"{path}: {len(tasks)} tasks (seed {SPLIT_SEEDS[split]})")


if __name__ == "__main__":
    main()
