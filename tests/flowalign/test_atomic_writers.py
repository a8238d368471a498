"""The model-folder writers (``save_tiny``, ``save_tiny_hpsv3``) write atomically and never over a user's files.

A writer that dies mid-file (a full disk: safetensors raises after writing part of its file) must leave the
folder it was replacing byte for byte as it was, with no partial file and no temporary beside it; a folder
holding a file the writer did not write is refused unless ``overwrite``, which keeps that file.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import safetensors.torch

from flowalign.errors import UserError
from flowalign.io import atomic_dir, atomic_path


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` (hidden ones too) by relative path, with its bytes."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _dying(real):
    """``safetensors.torch.save_file`` that writes half of its file at the path it was given, then fails as on a
    full disk."""

    def save_file(tensors, filename, metadata=None):
        real(tensors, filename, metadata=metadata)
        data = Path(filename).read_bytes()
        Path(filename).write_bytes(data[: len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    return save_file


def test_a_tiny_model_write_that_fails_leaves_the_previous_folder(tmp_path, monkeypatch):
    from pipelines.tiny import save_tiny

    folder = tmp_path / "model"
    save_tiny("sd3", folder, seed=0)
    before = snapshot(folder)
    assert any(name.endswith(".safetensors") for name in before)
    real = safetensors.torch.save_file
    with monkeypatch.context() as m:
        m.setattr(safetensors.torch, "save_file", _dying(real))
        with pytest.raises(OSError, match="No space left"):
            save_tiny("sd3", folder, seed=1)
    assert snapshot(folder) == before  # no partial file, no temporary, the weights of seed 0 intact
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_a_tiny_hpsv3_write_that_fails_leaves_the_previous_folder(tmp_path, monkeypatch):
    from rewards.hpsv3 import CHECKPOINT, save_tiny_hpsv3

    folder = tmp_path / "hpsv3"
    save_tiny_hpsv3(folder, seed=0)
    before = snapshot(folder)
    assert CHECKPOINT in before
    real = safetensors.torch.save_file
    with monkeypatch.context() as m:
        m.setattr(safetensors.torch, "save_file", _dying(real))
        with pytest.raises(OSError, match="No space left"):
            save_tiny_hpsv3(folder, seed=1)
    assert snapshot(folder) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hpsv3"]


def test_the_writers_keep_a_users_files(tmp_path):
    from pipelines.tiny import save_tiny
    from rewards.hpsv3 import save_tiny_hpsv3

    for name, write in (("model", lambda f, **kw: save_tiny("sd3", f, **kw)), ("hpsv3", save_tiny_hpsv3)):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "notes.txt").write_text("the user's own\n")
        with pytest.raises(UserError, match="holds files this command did not write"):
            write(folder)
        assert snapshot(folder) == {"notes.txt": b"the user's own\n"}
        write(folder, overwrite=True)  # asked: its own files written, the user's kept
        assert (folder / "notes.txt").read_text() == "the user's own\n" and len(snapshot(folder)) > 2


def test_atomic_path_flushes_the_file_before_the_rename(tmp_path, monkeypatch):
    events = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))) or real_fsync(fd))
    monkeypatch.setattr(os, "replace", lambda a, b: events.append(("replace", str(a))) or real_replace(a, b))
    with atomic_path(tmp_path / "a.json") as tmp:
        tmp.write_text("{}\n")
    assert events[:2] == [("fsync", str(tmp)), ("replace", str(tmp))]
    assert ("fsync", str(tmp_path)) in events[2:]  # the folder's entry too


def test_an_atomic_dir_inside_another_writes_into_it(tmp_path):
    """A library writer that is atomic itself, called by a command that is too, writes once: no temporary or
    marker of its own inside the command's folder."""
    out = tmp_path / "out"
    with atomic_dir(out, writer="outer") as tmp:
        with atomic_dir(tmp, writer="outer") as inner:
            assert inner == tmp
            (inner / "weights.bin").write_bytes(b"1")
        with atomic_dir(tmp / "sub", writer="outer") as sub:
            (sub / "x").write_text("x")
    assert sorted(p.name for p in out.iterdir()) == [".flowalign-outer.json", "sub", "weights.bin"]
    assert sorted(p.name for p in (out / "sub").iterdir()) == ["x"]
