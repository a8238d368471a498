"""A full disk while writing: one line naming the folder and the space needed (and, in training, which
checkpoint is intact) instead of a writer's traceback."""

from __future__ import annotations

import errno
import shutil
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from flowalign import checkpoint as ckpt
from flowalign.errors import UserError

FULL = (errno.ENOSPC, errno.EDQUOT)
#: how writers that drop the OSError report it: safetensors (Rust's io::Error) keeps the errno in its text
_FULL_TEXT = tuple(f"(os error {n})" for n in FULL) + ("no space left on device", "disk quota exceeded")
#: torch.save's stream writer keeps no errno at all: a full disk is told by the free space left
_WRITE_FAILED = "file write failed"


def is_disk_full(error: BaseException, folder: Path | None = None, needed: int = 0) -> bool:
    """Whether ``error``, raised while writing into ``folder``, means no space (or quota) is left."""
    if isinstance(error, OSError) and error.errno is not None:
        return error.errno in FULL
    text = str(error).lower()
    if any(t in text for t in _FULL_TEXT):
        return True
    if _WRITE_FAILED in text and folder is not None:
        try:
            return shutil.disk_usage(_existing(folder)).free < max(needed, 1)
        except OSError:
            return False
    return False


def _existing(path: Path) -> Path:
    return next(p for p in [Path(path).absolute(), *Path(path).absolute().parents] if p.exists())


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@contextmanager
def explain_no_space(folder: Path, needed: int, what: str) -> Iterator[None]:
    """Turn "no space left" while writing ``what`` into ``folder`` into a ``UserError`` naming the folder and
    the space needed; the writer's own ``finally`` has removed its temporaries by then."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 - writers raise their own types; is_disk_full tells them apart
        if not is_disk_full(e, folder, needed):
            raise
        raise UserError(f"no space left on the device of {folder} (writing {what}); it needs about {human(needed)} "
                        "free: free space there or choose another folder") from None


def human(size: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1024 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GB"


def checkpoint_bytes(run_dir: Path, params: Iterable[torch.Tensor]) -> int:
    """The size of the newest complete checkpoint, or without one an estimate from the trained tensors
    (the weights twice, as adapter and as exact tensors, and Adam's two moments)."""
    newest = ckpt.latest_checkpoint(run_dir)
    if newest is not None:
        return sum(p.stat().st_size for p in newest.rglob("*") if p.is_file())
    return 4 * tensor_bytes(params)


@contextmanager
def explain_full_disk(run_dir: Path, params: Iterable[torch.Tensor], keep: int) -> Iterator[None]:
    """Turn "no space left" inside the block into a ``UserError``; a half-written checkpoint is removed
    (the complete ones are untouched and the run resumes from the newest)."""
    params = list(params)
    try:
        yield
    except Exception as e:  # noqa: BLE001 - safetensors raises its own type; is_disk_full tells them apart
        if not is_disk_full(e, run_dir, checkpoint_bytes(run_dir, params)):
            raise
        for partial in (run_dir / "checkpoints").glob(".tmp-*"):
            shutil.rmtree(partial, ignore_errors=True)
        size = checkpoint_bytes(run_dir, params)
        newest = ckpt.latest_checkpoint(run_dir)
        kept = (f"{newest} is complete and the run resumes from it once space is freed" if newest else
                "no checkpoint was written yet, so once space is freed the rerun starts over")
        what = getattr(e, "filename", None) or "a checkpoint"
        raise UserError(f"no space left on the device of {run_dir} (writing {what}); a checkpoint "
                        f"needs about {human(size)} and run.keep_checkpoints={keep} of them are kept (plus one being "
                        f"written); {kept}") from None
