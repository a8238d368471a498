"""Folder manifests: every file's size and SHA-256 in ``manifest.json``, written after the files, so a
folder that no longer matches (a truncated or zero-byte file, a missing one, changed bytes) is recognised.
Checkpoints (:mod:`flowalign.checkpoint`) write one last; :mod:`flowalign.checkpoint_manifest` decides from
it which checkpoint to resume from."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from flowalign.io import write_json

MANIFEST = "manifest.json"


def sha256_file(path: Path) -> str:
    """The hex SHA-256 of a file, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _files(folder: Path, skip: set[str]) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.relative_to(folder).as_posix() not in skip)


def write_manifest(folder: Path, skip: set[str]) -> None:
    """Record every file of ``folder`` (but ``skip``) with its size and SHA-256 in ``manifest.json``."""
    files = {p.relative_to(folder).as_posix(): {"size": p.stat().st_size, "sha256": sha256_file(p)}
             for p in _files(folder, skip | {MANIFEST})}
    write_json(folder / MANIFEST, {"files": files})


def mismatch(folder: Path) -> str | None:
    """How ``folder`` differs from its ``manifest.json`` (None: it matches). Checks sizes first, hashes after."""
    try:
        listed: dict[str, Any] = json.loads((folder / MANIFEST).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{MANIFEST} is unreadable ({type(e).__name__})"
    for name, entry in listed.items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != entry["size"]:
            return f"{name} has {path.stat().st_size} bytes, the manifest says {entry['size']}"
    for name, entry in listed.items():
        if sha256_file(folder / name) != entry["sha256"]:
            return f"{name} does not match its checksum"
    return None
