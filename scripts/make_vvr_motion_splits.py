"""Write the fixed VVR motion benchmark splits: ``assets/vvr_motion/<level>/{validation,test}.jsonl``.

    python scripts/make_vvr_motion_splits.py [--n 500] [--out assets/vvr_motion]

One ``MotionTask.to_dict()`` per line, 500 tasks per split and level, drawn with the fixed seeds
``rewards.vvr_motion.SPLIT_SEEDS``: ``test`` holds only tasks with a held-out composition
(``rewards.vvr_motion.heldout``, never produced for training), ``validation`` is drawn from the training
distribution with its own seeds. The output is deterministic: rerunning rewrites identical files.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


from flowalign.io import atomic_path  # noqa: E402
from rewards.vvr_motion.splits import SPLIT_SEEDS, SPLIT_SIZE, draw_split  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=SPLIT_SIZE, help="tasks per split and level")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "assets" / "vvr_motion")
    args = parser.parse_args(argv)
    for split, seeds in SPLIT_SEEDS.items():
        for level, seed in seeds.items():
            tasks = draw_split(level, split, args.n, seed)
            path = args.out / level / f"{split}.jsonl"
            with atomic_path(path) as tmp:
                tmp.write_text("".join(json.dumps(t.to_dict(), sort_keys=True) + "\n" for t in tasks))
            print(f"{path}: {len(tasks)} tasks, {len({t.prompt for t in tasks})} distinct prompts (seed {seed})")


if __name__ == "__main__":
    main()
