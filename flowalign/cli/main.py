"""Entry point of the ``flowalign`` console script (and ``python -m flowalign``)."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

# On shared CPU cores, OpenMP workers that spin while a sibling thread is descheduled make steps several
# times slower; passive waiting costs nothing measurable when the cores are free. Must precede torch.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from flowalign.errors import UserError

# sub-command modules, each defining add_parser(subparsers) and run(args)
COMMANDS = (
    "tiny",
    "sample",
    "evaluate",
    "train",
    "plan",
    "gallery",
    "train_reward",
    "serve_judge",
)


def build_parser() -> argparse.ArgumentParser:
    import importlib

    parser = argparse.ArgumentParser(prog="flowalign", description="Align flow-matching generators with RL.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        module = importlib.import_module(f"flowalign.cli.{name}")
        module.add_parser(sub).set_defaults(_run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # key=value overrides may also follow the options (flowalign plan CFG --gpus 8 model.dtype=bf16)
    if extra and isinstance(getattr(args, "overrides", None), list) and all("=" in e and not e.startswith("-") for e in extra):
        args.overrides += extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        args._run(args)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
