"""``flowalign tiny-reward NAME --out DIR``: write a tiny, randomly initialised weights folder of a model reward.

``rewards.load(NAME, path=DIR)`` then loads it through the reward's real loading code (see
:mod:`rewards.tiny_rewards`). A folder holding other files is refused without ``--overwrite``; the folder
it wrote before is its own (its marker file lists the entries it replaces).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from flowalign.cli.out_dir import add_out_dir_args

#: the writer name of the folders this command writes (:func:`flowalign.io.atomic_dir`)
WRITER = "tiny-reward"


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from rewards.tiny_rewards import TINY_BUILDERS

    p = sub.add_parser("tiny-reward", help="build a tiny architecture-faithful reward-model folder (offline)")
    p.add_argument("name", choices=sorted(TINY_BUILDERS), help="the reward whose weights folder to build")
    add_out_dir_args(p, "folder to write (give it to the reward as path:)", "only its files are replaced")
    return p


def run(args: argparse.Namespace) -> None:
    from flowalign.io import atomic_dir, check_out_dir
    from rewards.tiny_rewards import TINY_BUILDERS

    check_out_dir(args.out, writer=WRITER, overwrite=args.overwrite)  # before the model is built
    with atomic_dir(args.out, writer=WRITER, overwrite=args.overwrite) as tmp:
        built = TINY_BUILDERS[args.name](tmp)
        # a builder may return the reward's options (several folders, e.g. a detector and a CLIP; an engine):
        # its folders are inside tmp, which becomes --out
        options = {k: Path(args.out) / v.relative_to(tmp) if isinstance(v, Path) else v for k, v in built.items()} \
            if isinstance(built, dict) else {"path": Path(args.out)}
    spec = ", ".join(f"{k}: {v}" for k, v in options.items())
    print(f"wrote tiny {args.name} reward weights to {args.out} (load with {{name: {args.name}, {spec}}})")
