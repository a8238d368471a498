"""Checkpoint manifests: every file's size and SHA-256, written last, so a damaged checkpoint is recognised
(a truncated or zero-byte tensor file, a missing optimiser or RNG file, a corrupt ``trainer_state.json``)
and ``resume: auto`` falls back to the newest checkpoint that is whole."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

from flowalign.errors import UserError
from flowalign.io import write_json

MANIFEST = "manifest.json"
#: suffix given to a damaged checkpoint folder that resume skipped (kept for inspection, never pruned)
DAMAGED = ".damaged"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _files(folder: Path, skip: set[str]) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.relative_to(folder).as_posix() not in skip)


def write_manifest(folder: Path, skip: set[str]) -> None:
    """Record every file of ``folder`` (but ``skip``) with its size and SHA-256 in ``manifest.json``."""
    files = {p.relative_to(folder).as_posix(): {"size": p.stat().st_size, "sha256": _sha256(p)}
             for p in _files(folder, skip | {MANIFEST})}
    write_json(folder / MANIFEST, {"files": files})


def damage(folder: Path) -> str | None:
    """Why ``folder`` cannot be resumed from (None: it verifies). Checks sizes first, hashes after."""
    try:
        listed: dict[str, Any] = json.loads((folder / MANIFEST).read_text())["files"]
    except FileNotFoundError:
        return _legacy_loads(folder)
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{MANIFEST} is unreadable ({type(e).__name__})"
    for name, entry in listed.items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != entry["size"]:
            return f"{name} has {path.stat().st_size} bytes, the manifest says {entry['size']}"
    for name, entry in listed.items():
        if _sha256(folder / name) != entry["sha256"]:
            return f"{name} does not match its checksum"
    return None


def _legacy_loads(folder: Path) -> str | None:
    """A checkpoint written before manifests: whole if every file it needs parses."""
    from flowalign.checkpoint import load_checkpoint

    try:
        state = load_checkpoint(folder)
        json.loads((folder / "rng-rank0.json").read_text())
        int(state["trainer_state"]["step"])
    except Exception as e:  # noqa: BLE001 - any failure to read means "not resumable", with its reason
        return f"it does not load ({type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''})"
    return None


def resume_folder(run_dir: Path, resume: str, *, main: bool) -> Path | None:
    """The checkpoint ``run.resume`` points at: with ``auto`` the newest that verifies (damaged newer ones
    are reported and, on the main process, renamed ``step-XXXXXX.damaged`` so they are never resumed or
    pruned in place of a whole one); a named folder must verify."""
    from flowalign.checkpoint import COMPLETE, list_checkpoints

    if resume != "auto":
        folder = Path(resume)
        if not (folder / COMPLETE).exists():
            raise UserError(f"run.resume={resume}: {folder} is not a complete checkpoint folder (no {COMPLETE})")
        reason = damage(folder)
        if reason:
            raise UserError(f"run.resume={resume}: the checkpoint is damaged ({reason}); name another "
                            "checkpoints/step-XXXXXX folder or set run.resume=auto")
        return folder
    for folder in reversed(list_checkpoints(run_dir)):
        reason = damage(folder)
        if reason is None:
            return folder
        if main:
            kept = damaged_name(folder)
            print(f"warning: skipping checkpoint {folder.name}: {reason}; kept as {kept.name}", file=sys.stderr)
            folder.rename(kept)
    return None


def damaged_name(folder: Path) -> Path:
    """A free name to keep a damaged ``folder`` under: ``step-N.damaged``, else ``step-N.damaged-2``, ...
    (the same step may be damaged again after the run redid it)."""
    candidate, n = folder.with_name(folder.name + DAMAGED), 1
    while candidate.exists() or candidate.is_symlink():
        n += 1
        candidate = folder.with_name(f"{folder.name}{DAMAGED}-{n}")
    return candidate
