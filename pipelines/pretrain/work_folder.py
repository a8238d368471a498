"""The ``--out`` work folder of ``flowalign pretrain-tiny``: refused when pretraining never worked there.

Stages checkpoint into ``OUT/vae``, ``OUT/dit`` and ``OUT/decoder``, read cached renders from
``OUT/data.*`` and move stale stages aside, so a folder of someone else's files (a model folder given as
``--out`` by mistake: it has a ``vae/`` too) must not become a work folder silently. A marker file says
the folder is pretraining's; a ``train.log`` says so for folders from before the marker.
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path

from flowalign.io import check_out_dir, marker_name, write_json

log = logging.getLogger("flowalign.pretrain")

WRITER = "pretrain-tiny"


def check_work_folder(out: Path, overwrite: bool) -> None:
    """Refuse (``UserError``, before anything is rendered) a non-empty ``out`` that holds files pretraining
    did not write, unless ``overwrite``."""
    if (out / "train.log").is_file() and not (out / marker_name(WRITER)).exists():
        return  # a work folder of an earlier version: every run logs there first
    check_out_dir(out, writer=WRITER, overwrite=overwrite, flag="--out")


def claim_work_folder(out: Path) -> None:
    """Create ``out`` and mark it as a pretraining work folder (resumes then find it theirs)."""
    out.mkdir(parents=True, exist_ok=True)
    if not (out / marker_name(WRITER)).exists():
        write_json(out / marker_name(WRITER), {"writer": WRITER, "entries": []})


def move_aside(out: Path, *stale: str) -> None:
    """Entries of ``out`` made stale by a stage given a larger budget: folders (stages) moved aside as
    ``NAME.stale-TIME``, files (caches) removed."""
    for name in stale:
        path = out / name
        if path.is_dir():
            shutil.move(path, out / f"{name}.stale-{int(time.time())}")
        elif path.exists():
            path.unlink()


def redo_after_vae(out: Path) -> None:
    """A finished VAE stage given a larger budget: the latents and everything trained on them are stale."""
    move_aside(out, "latents.safetensors", "dit", "decoder")
    log.info("vae: latents, dit and decoder will be redone")
