"""A full disk during training: one line saying how much a checkpoint needs and which one is intact."""

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
    return 4 * sum(p.numel() * p.element_size() for p in params)


@contextmanager
def explain_full_disk(run_dir: Path, params: Iterable[torch.Tensor], keep: int) -> Iterator[None]:
    """Turn "no space left" inside the block into a ``UserError``; a half-written checkpoint is removed
    (the complete ones are untouched and the run resumes from the newest)."""
    try:
        yield
    except OSError as e:
        if e.errno not in FULL:
            raise
        for partial in (run_dir / "checkpoints").glob(".tmp-*"):
            shutil.rmtree(partial, ignore_errors=True)
        size = checkpoint_bytes(run_dir, params)
        newest = ckpt.latest_checkpoint(run_dir)
        kept = f"{newest} is complete and the run resumes from it" if newest else "no checkpoint was written yet"
        raise UserError(f"no space left on the device of {run_dir} (writing {e.filename or 'run files'}); a checkpoint "
                        f"needs about {human(size)} and run.keep_checkpoints={keep} of them are kept (plus one being "
                        f"written); {kept} once space is freed") from None
