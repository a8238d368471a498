"""Fault injection for tests: the process SIGKILLs itself at the K-th call of a function, optionally after
leaving that call's file half-written (a torn write), and runs of the ``flowalign`` command in forked
children (the parent's imports are reused, so a restart costs the run, not the start-up)."""

from __future__ import annotations

import importlib
import os
import signal
import sys
from pathlib import Path


def _die() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def _tear(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _torn(target: str, real, args, kwargs):
    """Run ``real`` and cut in half what it wrote."""
    if target.endswith("RunLogger.log"):  # a metrics row cut mid-line
        logger, step, scalars = args[0], args[1], args[2]
        with open(logger.metrics_path, "a") as f:
            f.write(repr({"step": step, **scalars})[:20])
        return None
    out = real(*args, **kwargs)
    _tear(Path(out) if target.endswith("save_adapter") else Path(args[1]))
    return out


def install(target: str, k: int, mode: str) -> None:
    """Make ``module:attr`` (``attr`` may be ``Class.method``) kill the process at its ``k``-th call;
    ``mode`` is ``kill`` (before the call runs) or ``torn`` (after it ran, its file cut in half)."""
    module_name, _, attr = target.partition(":")
    owner = importlib.import_module(module_name)
    *parents, name = attr.split(".")
    for part in parents:
        owner = getattr(owner, part)
    real = getattr(owner, name)
    calls = {"n": 0}

    def faulty(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] != k:
            return real(*args, **kwargs)
        if mode == "torn":
            _torn(target, real, args, kwargs)
        _die()

    setattr(owner, name, faulty)


def run_forked(argv: list[str], fault: tuple[str, int, str] | None = None, wait: bool = True):
    """``flowalign ARGV`` in a forked child with ``fault`` installed; returns its exit code (-9: killed),
    or with ``wait=False`` its pid for :func:`exit_code`."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            if fault is not None:
                install(*fault)
            from flowalign.cli.main import main

            code = main(argv)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    return exit_code(pid) if wait else pid


def exit_code(pid: int) -> int:
    _, status = os.waitpid(pid, 0)
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
