"""Atomic file writing: a crash mid-write never leaves a half-written file behind."""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from flowalign import strict_json


def umask() -> int:
    """The process's umask, read without changing it where ``/proc`` tells it (other threads may be
    creating files meanwhile)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def temp_prefix(name: str, kind: str = "tmp") -> str:
    """The start of a temporary's hidden name beside ``name``, without the pid that :func:`with_pid` adds."""
    return f".{name}.{kind}-"


def with_pid(prefix: str) -> str:
    """``prefix`` and this process's pid: a killed writer's leftover (swept by :func:`sweep_stale`) is told
    apart from a live one's."""
    return f"{prefix}{os.getpid()}-"


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs on this machine (another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def sweep_stale(folder: Path, prefix: str) -> None:
    """Remove the temporaries ``PREFIX<pid>-*`` in ``folder`` whose writing process is gone (a kill
    mid-write strands them); a live writer's stay."""
    pattern = re.compile(rf"^{re.escape(prefix)}(\d+)-")
    try:
        entries = list(folder.iterdir())
    except OSError:
        return
    for p in entries:
        m = pattern.match(p.name)
        if m is None or pid_alive(int(m.group(1))):
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)


def _plain_mode(fd: int, kind: str, like: Path | None = None) -> None:
    """``mkstemp``/``mkdtemp`` create 0600/0700: give the file (``"file"``) or folder the mode a plain
    ``open``/``mkdir`` would (0666/0777 less the umask), or the mode of the file it replaces, so that a
    gallery stays readable by a web server and a shared folder by its group."""
    try:
        mode = stat.S_IMODE(os.stat(like).st_mode) if like is not None else None
    except OSError:
        mode = None
    os.chmod(fd, mode if mode is not None else (0o666 if kind == "file" else 0o777) & ~umask())


def fsync_file(path: str | Path) -> None:
    """Flush ``path``'s data to the disk: a rename onto a file's name is only as durable as the data it points
    at (after a power cut an unflushed file can come back empty under its new name)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(folder: str | Path) -> None:
    """Flush ``folder``'s entries (a rename into it) to the disk; a no-op where folders cannot be opened."""
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some file systems refuse fsync on a folder
        pass
    finally:
        os.close(fd)


def fsync_tree(folder: str | Path) -> None:
    """:func:`fsync_file` every regular file under ``folder`` and :func:`fsync_dir` every folder: before the
    rename that publishes the folder."""
    for root, _, files in os.walk(folder):
        for name in files:
            p = os.path.join(root, name)
            if os.path.isfile(p) and not os.path.islink(p):
                fsync_file(p)
        fsync_dir(root)


def plain_file_modes(folder: Path) -> None:
    """Give every ``.safetensors`` file under ``folder`` a plain file's mode (0666 less the umask):
    safetensors writes its files 0600 (it renames a private temporary onto the name), while the JSON
    written beside them follows the umask."""
    mode = 0o666 & ~umask()
    for p in Path(folder).rglob("*.safetensors"):
        if p.is_file() and not p.is_symlink():
            os.chmod(p, mode)


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success it is flushed to the disk and renamed onto ``path``
    (with the mode of the file it replaces, else the umask's, also when the writer replaced the temporary, as
    safetensors does). A failure inside the block leaves ``path`` as it was and no temporary behind."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    sweep_stale(path.parent, temp_prefix(path.name))
    fd, tmp = tempfile.mkstemp(prefix=with_pid(temp_prefix(path.name)), suffix=path.suffix, dir=path.parent)
    _plain_mode(fd, "file", like=path)
    mode = stat.S_IMODE(os.fstat(fd).st_mode)
    os.close(fd)
    try:
        yield Path(tmp)
        if os.path.isfile(tmp) and not os.path.islink(tmp):
            os.chmod(tmp, mode)
            fsync_file(tmp)
        os.replace(tmp, path)
        fsync_dir(path.parent)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def write_json(path: str | Path, data: Any) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(strict_json.dumps(data, indent=2, sort_keys=False) + "\n")


def write_jsonl(path: str | Path, rows: list[dict[str, Any]]) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text("".join(strict_json.dumps(r) + "\n" for r in rows))


#: hidden names inside an output folder that belong to the writing machinery, never to the user
TMP_PREFIX, OLD_PREFIX, MARKER_PREFIX = ".flowalign-tmp-", ".flowalign-old-", ".flowalign-"


def marker_name(writer: str) -> str:
    """The file that lists what ``writer`` (e.g. ``gallery``) put into a folder."""
    return f"{MARKER_PREFIX}{writer}.json"


def owned_entries(path: Path, writer: str) -> set[str]:
    """Top-level names ``writer`` wrote into ``path`` before (empty when it never did)."""
    try:
        return set(json.loads((path / marker_name(writer)).read_text())["entries"])
    except (OSError, ValueError, KeyError, TypeError):
        return set()


def _machinery(name: str) -> bool:
    return name.startswith(MARKER_PREFIX)


def foreign_entries(path: Path, writer: str) -> list[str]:
    """Top-level names in ``path`` that ``writer`` did not write (other writers' markers excepted)."""
    if not path.is_dir():
        return []
    owned = owned_entries(path, writer)
    return sorted(p.name for p in path.iterdir() if p.name not in owned and not _machinery(p.name))


def check_out_dir(path: str | Path, *, writer: str, overwrite: bool, flag: str = "--out") -> None:
    """Refuse (``UserError``) a folder ``writer`` may not write into: a file, or a non-empty folder it did
    not write before (unless ``overwrite``). Call it before expensive work; :func:`atomic_dir` repeats it."""
    from flowalign.errors import UserError

    path = Path(path)
    if path.exists() and not path.is_dir():
        raise UserError(f"{flag} {path} is a file; give a folder to write")
    _probe_writable(path, flag)
    if overwrite or not path.is_dir():
        return
    if not (path / marker_name(writer)).is_file():
        refuse_foreign(path, foreign_entries(path, writer), flag)


def _probe_writable(path: Path, flag: str) -> None:
    """Fail before any work when the nearest existing folder of ``path`` takes no files (read-only,
    ``/proc``, no permission); the probe is an unnamed temporary file, gone when closed."""
    from flowalign.errors import UserError

    existing = next(p for p in [path.absolute(), *path.absolute().parents] if p.exists())
    try:
        if not existing.is_dir():
            raise NotADirectoryError(20, "a part of the path is a file", str(existing))
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as e:
        raise UserError(f"{flag} {path}: cannot write there ({e.strerror}: {existing}); "
                        "choose a writable folder") from None


def check_out_file(path: str | Path, *, overwrite: bool, flag: str = "--out") -> None:
    """Refuse (``UserError``) an output file that exists (unless ``overwrite``) or is a folder, and a folder
    that takes no files; call it before expensive work."""
    from flowalign.errors import UserError

    path = Path(path)
    if path.is_dir():
        raise UserError(f"{flag} {path} is a folder; give a file name to write")
    if (path.exists() or path.is_symlink()) and not overwrite:
        raise UserError(f"{flag} {path} already exists; choose another name, or add --overwrite to replace it")
    _probe_writable(path.parent, flag)


def refuse_foreign(path: Path, foreign: list[str], flag: str) -> None:
    from flowalign.errors import UserError

    if foreign:
        shown = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
        raise UserError(f"{flag} {path} holds files this command did not write ({shown}); choose a new or empty "
                        f"folder, or add --overwrite to replace only the files it writes (the others are kept)")


#: the temporary folders :func:`atomic_dir` has yielded and not yet published (resolved paths)
_OPEN_DIRS: set[Path] = set()


def _inside_open_dir(path: Path) -> bool:
    resolved = path.resolve()
    return any(resolved == d or d in resolved.parents for d in _OPEN_DIRS)


@contextmanager
def atomic_dir(path: str | Path, *, writer: str, overwrite: bool = False, flag: str = "--out") -> Iterator[Path]:
    """Yield an empty temporary folder; on success its entries replace their namesakes in ``path``.

    Nothing ``writer`` did not write is ever removed: a new folder appears in one rename; into an existing
    one each entry is swapped in by rename and the entries ``writer`` wrote before (listed in its marker
    file, :func:`marker_name`) are dropped, while every other file stays. A non-empty folder that
    ``writer`` never wrote to is refused unless ``overwrite`` (which still only replaces the files it
    writes: into a sub-folder of the user's of a name it writes, its files are merged, the user's others
    kept). A failure inside the block leaves ``path`` untouched. The files are flushed to the disk before
    they are renamed into place.

    A ``path`` inside a folder that an enclosing ``atomic_dir`` yielded is written directly: that folder is
    new and published as a whole (a command that writes a folder through a library function that writes it
    atomically itself).
    """
    path = Path(path)
    if _inside_open_dir(path):
        path.mkdir(parents=True, exist_ok=True)
        yield path
        return
    check_out_dir(path, writer=writer, overwrite=overwrite, flag=flag)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        name = path.resolve().name
        sweep_stale(path.parent, temp_prefix(name))
        tmp = Path(tempfile.mkdtemp(prefix=with_pid(temp_prefix(name)), dir=path.parent))
        os.chmod(tmp, 0o777 & ~umask())  # it becomes ``path``: a plain folder's mode
        try:
            with _open_dir(tmp):
                yield tmp
            plain_file_modes(tmp)
            _write_marker(tmp, writer, sorted(p.name for p in tmp.iterdir()))
            fsync_tree(tmp)
            os.replace(tmp, path)  # a folder appearing since the check makes this fail, never merge
            fsync_dir(path.parent)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return
    _drop_leftovers(path)
    tmp = Path(tempfile.mkdtemp(prefix=TMP_PREFIX, dir=path))
    try:
        with _open_dir(tmp):
            yield tmp
        plain_file_modes(tmp)
        fsync_tree(tmp)
        _swap_in(tmp, path, writer, overwrite, flag)
        fsync_dir(path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextmanager
def _open_dir(tmp: Path) -> Iterator[None]:
    resolved = tmp.resolve()
    _OPEN_DIRS.add(resolved)
    try:
        yield
    finally:
        _OPEN_DIRS.discard(resolved)


def _write_marker(folder: Path, writer: str, entries: list[str]) -> None:
    write_json(folder / marker_name(writer), {"writer": writer, "entries": entries})


def _swap_in(tmp: Path, path: Path, writer: str, overwrite: bool, flag: str) -> None:
    """Move ``tmp``'s entries into ``path``; the old owned ones go to a trash folder deleted last."""
    new = sorted(p.name for p in tmp.iterdir())
    if not overwrite:  # its earlier output may sit beside a user's file of a name it now writes
        refuse_foreign(path, sorted(set(new) & set(foreign_entries(path, writer))), flag)
    owned = owned_entries(path, writer)
    # a user's folder of a name it writes (only with ``overwrite``): its files go in, the user's others stay
    merged = {n for n in new if n not in owned and _real_dir(path / n) and _real_dir(tmp / n)}
    replaced = sorted((owned | set(new)) - {marker_name(writer)} - merged)
    # a kill from here on leaves every name it may have touched listed as owned: the rerun replaces them
    _write_marker(path, writer, replaced)
    trash = Path(tempfile.mkdtemp(prefix=OLD_PREFIX, dir=path))
    for name in sorted(merged):
        _merge(tmp / name, path / name, trash / name)
    for name in replaced:
        if (path / name).exists() or (path / name).is_symlink():
            os.replace(path / name, trash / name)
        if name in new:
            os.replace(tmp / name, path / name)
    _write_marker(path, writer, sorted(set(new) - merged))
    shutil.rmtree(trash, ignore_errors=True)


def _real_dir(path: Path) -> bool:
    return path.is_dir() and not path.is_symlink()


def _merge(src: Path, dest: Path, trash: Path) -> None:
    """Move ``src``'s files into the existing folder ``dest``; a namesake goes to ``trash``, the rest stays."""
    for child in sorted(src.iterdir()):
        target = dest / child.name
        if _real_dir(child) and _real_dir(target):
            _merge(child, target, trash / child.name)
            continue
        if target.exists() or target.is_symlink():
            trash.mkdir(parents=True, exist_ok=True)
            os.replace(target, trash / child.name)
        os.replace(child, target)


def _drop_leftovers(path: Path) -> None:
    """Temporary and trash folders of an earlier write that was killed (their names are ours)."""
    for p in path.iterdir():
        if p.is_dir() and (p.name.startswith(TMP_PREFIX) or p.name.startswith(OLD_PREFIX)):
            shutil.rmtree(p, ignore_errors=True)


def remove_owned(path: str | Path, writer: str) -> None:
    """Delete what ``writer`` wrote into ``path`` (and ``path`` itself once empty); other files stay."""
    path = Path(path)
    if not path.is_dir():
        return
    for name in owned_entries(path, writer):
        target = path / name
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target, ignore_errors=True)
        elif target.exists() or target.is_symlink():
            target.unlink()
    (path / marker_name(writer)).unlink(missing_ok=True)
    _drop_leftovers(path)
    if not any(path.iterdir()):
        path.rmdir()
