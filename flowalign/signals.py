"""SIGTERM, what schedulers (SLURM, Kubernetes, systemd) send before they kill: a clean exit.

Outside the training loop SIGTERM raises :class:`Terminated` at once, so that ``finally`` blocks run (the
run's lock is released, temporaries are removed); inside it, :mod:`flowalign.trainers.loop` finishes the
step in flight and saves a checkpoint first. ``flowalign`` then prints one line and exits with
:data:`EXIT_CODE` (128 + SIGTERM, what a shell reports for a process the signal ended).

A step whose reward hangs would hold SIGTERM up until the reward's ``timeout_s``: so the loop notes the
signal here (:func:`request_stop`), and a wait for a reward inside an :func:`abandonable` block (a step's
rollouts and rewards, an evaluation: work that changes no weight) gives up at once, raising
:class:`Abandoned`; the loop then saves the last completed step and stops.
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


class Abandoned(Terminated):
    """A wait for a reward given up because SIGTERM came inside an :func:`abandonable` block: the step in
    flight is dropped, the weights are those of the last completed step."""

    def __init__(self, reward: str):
        super().__init__(f"SIGTERM received while reward {reward!r} was scoring; stopped")
        #: the name of the reward that was awaited
        self.reward = reward


#: set by the loop's SIGTERM handler; cleared when the loop ends
_stop = threading.Event()
#: how many :func:`abandonable` blocks are open (the main thread opens them; reward threads read it)
_open = [0]


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


def request_stop() -> None:
    """SIGTERM came while the loop runs: reward waits inside an :func:`abandonable` block give up."""
    _stop.set()


def clear_stop() -> None:
    _stop.clear()


def stop_requested() -> bool:
    return _stop.is_set()


@contextmanager
def abandonable(allowed: bool = True) -> Iterator[None]:
    """Inside the block, a reward wait gives up once SIGTERM came (:func:`should_abandon`). Only around
    work that changes no weight nor trainer state; ``allowed`` False (several ranks, whose collectives
    must stay in step) makes it a no-op."""
    if not allowed:
        yield
        return
    _open[0] += 1
    try:
        yield
    finally:
        _open[0] -= 1


def should_abandon() -> bool:
    """Whether a reward wait should give up now: SIGTERM came inside an :func:`abandonable` block."""
    return _stop.is_set() and _open[0] > 0
