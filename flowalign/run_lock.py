"""One live ``flowalign train`` per run folder: the owner holds an exclusive ``flock`` on ``train.lock``,
which records its pid, host and process start time. A second run on the same folder refuses; a lock whose
process is gone is free (the kernel dropped it) and taken over with a warning, by one process only
however many start at once."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from flowalign.errors import UserError
from flowalign.io import marker_name, pid_alive

LOCK_NAME = "train.lock"
#: the writer name of a run folder (:func:`flowalign.io.marker_name`): its marker says a run claimed it
RUN_WRITER = "train"


def _start_time(pid: int) -> str | None:
    """The kernel's start tick of ``pid`` (tells a reused pid apart), or None where /proc is absent."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # field 22, counted after the parenthesised name


def _alive(owner: dict[str, Any]) -> bool:
    pid = int(owner["pid"])
    if not pid_alive(pid):
        return False
    started = owner.get("start")
    return started is None or _start_time(pid) in (None, started)


def _owner(lock: Path) -> dict[str, Any] | None:
    try:
        owner = json.loads(lock.read_text())
        int(owner["pid"])
        return owner
    except (OSError, ValueError, KeyError, TypeError):
        return None


#: open lock files of this process, by path: the kernel's lock lives as long as the descriptor
_HELD: dict[Path, int] = {}


def _flock(lock: Path) -> int | None:
    """Open ``lock`` (creating it) and take its exclusive ``flock``; the descriptor, or None when another
    process holds it. The kernel drops the lock of a process that dies, so at most one process at a time
    gets past this however many race for a stale lock; a file unlinked by its releasing owner between
    our open and our lock is noticed (it is no longer the one at ``lock``) and opened again."""
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        except OSError as e:
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                os.close(fd)
                raise
            return fd  # a file system without locks: the recorded owner's pid is all there is to go by
        except BaseException:
            os.close(fd)
            raise
        try:
            if os.stat(lock).st_ino == os.fstat(fd).st_ino:
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)


def _write_owner(fd: int, me: dict[str, Any]) -> None:
    data = (json.dumps(me) + "\n").encode()
    os.pwrite(fd, data, 0)
    os.ftruncate(fd, len(data))
    os.fsync(fd)


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
    fd = _flock(lock)
    owner = _owner(lock)
    if fd is None:  # held by a live process (its file may be mid-write: then its pid is unknown)
        pid = owner["pid"] if owner else "unknown"
        where = f" on host {owner.get('host')}" if owner and owner.get("host") != me["host"] else ""
        since = owner.get("since") if owner else "unknown"
        raise UserError(f"run.output_dir {run_dir} is in use by another flowalign train (pid {pid}{where}, "
                        f"since {since}); wait for it to finish or choose another run.output_dir")
    try:
        # the lock file's own lock is free; what it records may still name a live owner that holds no
        # lock (a file system without flock across hosts, an older flowalign): those refuse as before
        if owner is not None and owner.get("host") != me["host"]:
            raise UserError(f"run.output_dir {run_dir} is in use by pid {owner['pid']} on host {owner.get('host')} "
                            f"(since {owner.get('since')}); wait for it, choose another run.output_dir, or delete "
                            f"{lock} if that run is gone")
        if owner is not None and owner["pid"] != me["pid"] and _alive(owner):
            raise UserError(f"run.output_dir {run_dir} is in use by another flowalign train (pid {owner['pid']}, "
                            f"since {owner.get('since')}); wait for it to finish or choose another run.output_dir")
        if owner is not None or lock.stat().st_size:
            reason = f"pid {owner['pid']} is no longer running" if owner else "unreadable"
            print(f"warning: taking over the stale lock {lock} ({reason})", file=sys.stderr)
        _write_owner(fd, me)
    except BaseException:
        os.close(fd)
        raise
    _HELD[lock] = fd
    return lock


def release(lock: Path) -> None:
    """Drop the lock if it is still ours; the folder too if nothing else was ever written there (but the
    run's marker)."""
    fd = _HELD.pop(lock, None)
    owner = _owner(lock)
    if owner is not None and owner["pid"] == os.getpid() and owner.get("host") == socket.gethostname():
        lock.unlink(missing_ok=True)  # before the lock goes: a racer that opened it sees it unlinked
    if fd is not None:
        os.close(fd)
    folder = lock.parent
    if folder.is_dir() and {p.name for p in folder.iterdir()} <= {marker_name(RUN_WRITER)}:
        try:
            (folder / marker_name(RUN_WRITER)).unlink(missing_ok=True)
            folder.rmdir()
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
