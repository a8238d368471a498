"""Write the fixed VVR editing splits: ``assets/vvr_edit/<level>/{validation,test}.jsonl``.

    python scripts/make_vvr_edit_splits.py [--n 100] [--out assets/vvr_edit]

One ``EditTask.to_dict()`` per line, ``--n`` tasks per level and split, drawn with ``heldout="only"`` (every task
acts on a composition training never sees) and the seeds ``rewards.vvr_edit.SPLIT_SEEDS``. Deterministic.
"""

from __future__ import annotations

from rewards.vvr_edit import SPLIT_SEEDS, generate_edit_tasks
from rewards.vvr_edit.generate import LEVELS
from rewards.vvr_edit.splits import SPLIT_SIZE
from split_files import split_arguments, write_split


def main(argv: list[str] | None = None) -> None:
    args = split_arguments(__doc__, "vvr_edit", SPLIT_SIZE, "tasks per level and split", argv)
    for level in LEVELS:
        for split, seed in SPLIT_SEEDS.items():
            tasks = generate_edit_tasks(args.n, seed=seed, level=level, heldout="only")
            write_split(args.out / level / f"{split}.jsonl", [t.to_dict() for t in tasks],
                        f"{len(tasks)} tasks (seed {seed})")


if __name__ == "__main__":
    main()
