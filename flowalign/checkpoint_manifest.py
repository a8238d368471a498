"""Which checkpoint to resume from: one whose manifest (:mod:`flowalign.manifest`, written last) no longer
matches is damaged (a truncated or zero-byte tensor file, a missing optimiser or RNG file, a corrupt
``trainer_state.json``), and ``resume: auto`` falls back to the newest checkpoint that is whole."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from flowalign.checkpoint import COMPLETE, list_checkpoints, load_checkpoint
from flowalign.errors import UserError
from flowalign.manifest import MANIFEST, mismatch

#: suffix given to a damaged checkpoint folder that resume skipped (kept for inspection, never pruned)
DAMAGED = ".damaged"


def damage(folder: Path) -> str | None:
    """Why ``folder`` cannot be resumed from (None: it verifies against its manifest, or, written before
    manifests, it loads)."""
    return mismatch(folder) if (folder / MANIFEST).exists() else _legacy_loads(folder)


def _legacy_loads(folder: Path) -> str | None:
    """A checkpoint written before manifests: whole if every file it needs parses."""
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


def resolve_checkpoint(folder: Path) -> Path | None:
    """The checkpoint a folder stands for: a run folder's (one with ``checkpoints/``) newest checkpoint that
    verifies (None: none yet), any other folder itself (a checkpoint or an adapter)."""
    return resume_folder(folder, "auto", main=False) if (folder / "checkpoints").is_dir() else folder


def damaged_name(folder: Path) -> Path:
    """A free name to keep a damaged ``folder`` under: ``step-N.damaged``, else ``step-N.damaged-2``, ...
    (the same step may be damaged again after the run redid it)."""
    candidate, n = folder.with_name(folder.name + DAMAGED), 1
    while candidate.exists() or candidate.is_symlink():
        n += 1
        candidate = folder.with_name(f"{folder.name}{DAMAGED}-{n}")
    return candidate
