"""Write the fixed VVR benchmark splits: ``assets/vvr/<level>/{validation,test}.jsonl``.

    python scripts/make_vvr_splits.py [--n 500] [--out assets/vvr]

One ``Task.to_dict()`` per line, 500 tasks per split and level, drawn with the fixed seeds
``rewards.vvr.splits.SPLIT_SEEDS``: ``test`` holds only tasks with a held-out composition
(``rewards.vvr.heldout``, never produced for training), ``validation`` is drawn from the training
distribution with its own seeds. The output is deterministic: rerunning rewrites identical files.
"""

from __future__ import annotations

from rewards.vvr.splits import SPLIT_SEEDS, SPLIT_SIZE, draw_split
from split_files import split_arguments, write_level_splits


def main(argv: list[str] | None = None) -> None:
    args = split_arguments(__doc__, "vvr", SPLIT_SIZE, "tasks per split and level", argv)
    write_level_splits(args.out, SPLIT_SEEDS, draw_split, args.n)


if __name__ == "__main__":
    main()
