"""SIGTERM, what schedulers (SLURM, Kubernetes, systemd) send before they kill: a clean exit.

Outside the training loop SIGTERM raises :class:`Terminated` at once, so that ``finally`` blocks run (the
run's lock is released, temporaries are removed); inside it, :mod:`flowalign.trainers.loop` finishes the
step in flight and saves a checkpoint first. ``flowalign`` then prints one line and exits with
:data:`EXIT_CODE` (128 + SIGTERM, what a shell reports for a process the signal ended).
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from typing import Iterator

EXIT_CODE = 128 + signal.SIGTERM


class Terminated(BaseException):
    """SIGTERM was received; a ``BaseException`` like ``KeyboardInterrupt``, so that no ``except
    Exception`` swallows it. Its message says what was kept."""


def raise_terminated(signum: int, frame: object) -> None:
    raise Terminated("SIGTERM received; stopped")


@contextmanager
def exit_on_sigterm() -> Iterator[None]:
    """Turn SIGTERM into :class:`Terminated` inside the block (main thread only; elsewhere a no-op)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
