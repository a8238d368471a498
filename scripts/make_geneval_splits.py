"""Write the fixed GenEval-style splits: ``assets/geneval/{validation,test}.jsonl``.

    python scripts/make_geneval_splits.py [--n 600] [--out assets/geneval]

One GenEval metadata line per task, drawn with the fixed seeds ``rewards.geneval.splits.SPLIT_SEEDS``:
``test`` holds only held-out compositions, ``validation`` the training distribution. Deterministic:
rerunning rewrites identical files.
"""

from __future__ import annotations

from rewards.geneval.splits import SPLIT_SEEDS, SPLIT_SIZE, draw_split
from split_files import split_arguments, write_split


def main(argv: list[str] | None = None) -> None:
    args = split_arguments(__doc__, "geneval", SPLIT_SIZE, "tasks per split (at most; see the test split)", argv)
    for split in SPLIT_SEEDS:
        tasks = draw_split(split, args.n)
        write_split(args.out / f"{split}.jsonl", tasks, f"{len(tasks)} tasks (seed {SPLIT_SEEDS[split]})",
                    sort_keys=False)


if __name__ == "__main__":
    main()
