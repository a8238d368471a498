"""Entry point of the ``flowalign`` console script (and ``python -m flowalign``).

A sub-command is a module with ``add_parser(subparsers) -> ArgumentParser`` and ``run(args)``. The core's
own are the modules of this package (``flowalign/cli/<name>.py`` is the command ``<name>`` with ``_`` as
``-``); the other packages contribute theirs as plugins of kind ``commands`` (:mod:`flowalign.plugins`:
entry points of the group ``flowalign.commands``, or the built-in ``PLUGINS`` tables), e.g.
``serve-judge`` from ``rewards`` and ``tiny`` from ``pipelines``. A command's module is imported only
when that command runs (or when ``--help`` lists them all), so at its top it imports only what its parser
needs: torch, diffusers and the like are imported inside ``run`` (tests/flowalign/cli/test_main.py).
"""

from __future__ import annotations

import argparse
import errno
import math
import os
import pkgutil
import sys
from pathlib import Path
from typing import Sequence

# On shared CPU cores, OpenMP workers that spin while a sibling thread is descheduled make steps several
# times slower; passive waiting costs nothing measurable when the cores are free. Must precede torch.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from flowalign.errors import UserError
from flowalign.signals import EXIT_CODE as TERMINATED_EXIT, Terminated

#: modules of this package that are not commands
NOT_COMMANDS = {"main", "common", "out_dir"}


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


def core_commands() -> dict[str, str]:
    """``name → module`` of the core's own commands, found on disk without importing them."""
    folder = str(Path(__file__).resolve().parent)
    return {info.name.replace("_", "-"): f"flowalign.cli.{info.name}" for info in pkgutil.iter_modules([folder])
            if info.name not in NOT_COMMANDS and not info.name.startswith("_")}


def command_target(name: str) -> str | None:
    """The module of command ``name``: the core's, else an entry point's, else a built-in plugin's.
    Looked up in that order so that running a command imports as little as possible."""
    from importlib.metadata import entry_points

    from flowalign.plugins import builtin_target

    found = core_commands().get(name)
    found = found or next((ep.value for ep in entry_points(group="flowalign.commands") if ep.name == name), None)
    return found or builtin_target("commands", name)


def all_commands() -> dict[str, str]:
    """``name → module`` of every command (the core's win a name clash), sorted by name."""
    from flowalign.plugins import targets

    found = {**targets("commands"), **core_commands()}
    return dict(sorted(found.items()))


def build_parser(commands: dict[str, str] | None = None) -> argparse.ArgumentParser:
    """The parser with the sub-commands ``commands`` (default: all of them, each module imported)."""
    from flowalign.plugins import load_target

    parser = argparse.ArgumentParser(prog="flowalign", description="Align flow-matching generators with RL.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, target in (all_commands() if commands is None else commands).items():
        module = load_target(target)
        p = module.add_parser(sub)
        if name not in sub.choices or sub.choices[name] is not p:
            raise RuntimeError(f"command module {target} must add a sub-parser named {name!r}")
        p.set_defaults(_run=module.run)
    return parser


def parser_for(argv: Sequence[str]) -> argparse.ArgumentParser:
    """Only the named command's module is imported; ``--help``, typos and no command get them all."""
    name = argv[0] if argv and not argv[0].startswith("-") else None
    target = command_target(name) if name else None
    return build_parser({name: target} if target else None)


def parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """``parser``'s reading of ``argv``; key=value overrides may also follow the options
    (``flowalign plan CFG --gpus 8 model.dtype=bf16``)."""
    args, extra = parser.parse_known_args(argv)
    if extra and isinstance(getattr(args, "overrides", None), list) and all("=" in e and not e.startswith("-")
                                                                          for e in extra):
        args.overrides += extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    refuse_non_finite(args)
    return args


def refuse_non_finite(args: argparse.Namespace) -> None:
    """argparse's ``float`` reads ``nan`` and ``inf``; no option means either (a NaN guidance scale would
    score black images), so they are refused here for every command."""
    for name, value in vars(args).items():
        values = value if isinstance(value, (list, tuple)) else [value]
        if any(isinstance(v, float) and not math.isfinite(v) for v in values):
            raise UserError(f"--{name.replace('_', '-')} {value}: give a finite number")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = parse(parser_for(argv), argv)
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
    except Terminated as e:
        print(f"terminated: {e}", file=sys.stderr)
        return TERMINATED_EXIT
    return 0


if __name__ == "__main__":
    sys.exit(main())
