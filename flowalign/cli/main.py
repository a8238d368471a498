"""Entry point of the ``flowalign`` console script (and ``python -m flowalign``)."""

from __future__ import annotations

import argparse
import errno
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
    "gallery",
    "train_reward",
    "serve_judge",
)


#: errors of the file system a user can fix (a path, permissions, space), with the fix
FILE_SYSTEM_ERRORS = {
    errno.ENOENT: "; check the path (a folder under it cannot be created)",
    errno.EACCES: "; choose a folder you may write to",
    errno.EPERM: "; choose a folder you may write to",
    errno.EROFS: " (a read-only file system); choose a writable folder",
    errno.ENOSPC: "; free space on that device or write elsewhere",
    errno.EDQUOT: "; free space in your quota or write elsewhere",
    errno.ENOTDIR: "; a part of the path is a file, not a folder",
}


def build_parser() -> argparse.ArgumentParser:
    import importlib

    parser = argparse.ArgumentParser(prog="flowalign", description="Align flow-matching generators with RL.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        module = importlib.import_module(f"flowalign.cli.{name}")
        module.add_parser(sub).set_defaults(_run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args._run(args)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        if e.errno not in FILE_SYSTEM_ERRORS:
            raise
        print(f"error: {e.strerror}: {e.filename or 'a file'}{FILE_SYSTEM_ERRORS[e.errno]}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
