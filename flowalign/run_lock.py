"""One live ``flowalign train`` per run folder: ``train.lock`` holds the owner's pid, host and process start
time. A second run on the same folder refuses; a lock whose process is gone (same host) is stale and taken
over with a warning."""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from flowalign.errors import UserError

LOCK_NAME = "train.lock"


def _start_time(pid: int) -> str | None:
    """The kernel's start tick of ``pid`` (tells a reused pid apart), or None where /proc is absent."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # field 22, counted after the parenthesised name


def _alive(owner: dict[str, Any]) -> bool:
    pid = int(owner["pid"])
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    started = owner.get("start")
    return started is None or _start_time(pid) in (None, started)


def _owner(lock: Path) -> dict[str, Any] | None:
    try:
        owner = json.loads(lock.read_text())
        int(owner["pid"])
        return owner
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _try_create(lock: Path, me: dict[str, Any]) -> bool:
    """Create ``lock`` with ``me`` in it unless it exists (a hard link is atomic and never half-written)."""
    tmp = lock.with_name(f".{LOCK_NAME}.{os.getpid()}")
    tmp.write_text(json.dumps(me) + "\n")
    try:
        os.link(tmp, lock)
        return True
    except FileExistsError:
        return False
    finally:
        tmp.unlink(missing_ok=True)


def acquire(run_dir: Path) -> Path:
    """Take ``run_dir``'s lock (creating the folder) or raise ``UserError`` naming the live owner."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"run.output_dir {run_dir}: cannot create it ({e.strerror}); "
                        "choose a writable folder") from None
    lock = run_dir / LOCK_NAME
    me = {"pid": os.getpid(), "host": socket.gethostname(), "start": _start_time(os.getpid()),
          "since": time.strftime("%Y-%m-%d %H:%M:%S")}
    for _ in range(3):
        if _try_create(lock, me):
            return lock
        owner = _owner(lock)
        if owner is None:
            reason = "unreadable"
        elif owner.get("host") != me["host"]:
            raise UserError(f"run.output_dir {run_dir} is in use by pid {owner['pid']} on host {owner.get('host')} "
                            f"(since {owner.get('since')}); wait for it, choose another run.output_dir, or delete "
                            f"{lock} if that run is gone")
        elif owner["pid"] != me["pid"] and _alive(owner):
            raise UserError(f"run.output_dir {run_dir} is in use by another flowalign train (pid {owner['pid']}, "
                            f"since {owner.get('since')}); wait for it to finish or choose another run.output_dir")
        else:
            reason = f"pid {owner['pid']} is no longer running"
        print(f"warning: taking over the stale lock {lock} ({reason})", file=sys.stderr)
        lock.unlink(missing_ok=True)
    raise UserError(f"could not lock {lock}; another process keeps creating it")


def release(lock: Path) -> None:
    """Drop the lock if it is still ours; the folder too if nothing else was ever written there."""
    owner = _owner(lock)
    if owner is not None and owner["pid"] == os.getpid() and owner.get("host") == socket.gethostname():
        lock.unlink(missing_ok=True)
    if lock.parent.is_dir() and not any(lock.parent.iterdir()):
        try:
            lock.parent.rmdir()
        except OSError:  # e.g. the working folder itself
            pass


@contextmanager
def run_lock(run_dir: Path) -> Iterator[None]:
    """Hold ``run_dir``'s lock on the first process of a launch (``RANK`` 0); other ranks take none."""
    if int(os.environ.get("RANK", "0")) != 0:
        yield
        return
    lock = acquire(Path(run_dir))
    try:
        yield
    finally:
        release(lock)
