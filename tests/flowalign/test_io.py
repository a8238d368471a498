"""Output folders: written atomically, and nothing the writer did not write is ever removed."""

import json
import os
import stat
import subprocess

import pytest

from flowalign.errors import UserError
from flowalign.io import atomic_dir, check_out_dir, marker_name, owned_entries, remove_owned


def _write(path, files, **kw):
    with atomic_dir(path, writer="demo", **kw) as tmp:
        for name, text in files.items():
            (tmp / name).write_text(text)


def test_new_folder_appears_whole_with_its_marker(tmp_path):
    out = tmp_path / "a" / "b"
    _write(out, {"x.txt": "1", "y.txt": "2"})
    assert sorted(p.name for p in out.iterdir()) == sorted(["x.txt", "y.txt", marker_name("demo")])
    assert owned_entries(out, "demo") == {"x.txt", "y.txt"}
    assert [p.name for p in tmp_path.iterdir()] == ["a"] and [p.name for p in (tmp_path / "a").iterdir()] == ["b"]


def test_foreign_folder_is_refused_and_untouched(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="--overwrite") as err:
        _write(tmp_path, {"x.txt": "1"})
    assert "notes.txt" in str(err.value) and len(str(err.value).splitlines()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_overwrite_and_reruns_replace_only_owned_files(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    _write(tmp_path, {"x.txt": "1", "old.txt": "stale"}, overwrite=True)
    assert (tmp_path / "notes.txt").read_text() == "mine" and (tmp_path / "x.txt").read_text() == "1"
    _write(tmp_path, {"x.txt": "2"})  # its own earlier output: no --overwrite needed
    assert (tmp_path / "x.txt").read_text() == "2" and not (tmp_path / "old.txt").exists()
    assert (tmp_path / "notes.txt").read_text() == "mine"
    assert json.loads((tmp_path / marker_name("demo")).read_text())["entries"] == ["x.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["notes.txt", "x.txt", marker_name("demo")])


def test_a_user_file_named_like_new_output_needs_overwrite(tmp_path):
    _write(tmp_path, {"x.txt": "1"})
    (tmp_path / "y.txt").write_text("mine")
    with pytest.raises(UserError, match="y.txt"):
        _write(tmp_path, {"x.txt": "2", "y.txt": "theirs"})
    assert (tmp_path / "x.txt").read_text() == "1" and (tmp_path / "y.txt").read_text() == "mine"


def test_failure_inside_leaves_the_folder_as_it_was(tmp_path):
    _write(tmp_path, {"x.txt": "1"})
    with pytest.raises(RuntimeError):
        with atomic_dir(tmp_path, writer="demo") as tmp:
            (tmp / "x.txt").write_text("half")
            raise RuntimeError("killed")
    assert (tmp_path / "x.txt").read_text() == "1"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["x.txt", marker_name("demo")])


def test_leftovers_of_a_killed_write_are_cleaned_and_other_writers_coexist(tmp_path):
    _write(tmp_path, {"x.txt": "1"})
    (tmp_path / ".flowalign-old-abc").mkdir()
    with atomic_dir(tmp_path, writer="other", overwrite=True) as tmp:  # "demo"'s files are foreign to it
        (tmp / "z.txt").write_text("z")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["x.txt", "z.txt", marker_name("demo"), marker_name("other")])
    remove_owned(tmp_path, "demo")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["z.txt", marker_name("other")])


def test_a_file_is_not_a_folder(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(UserError, match="is a file"):
        check_out_dir(tmp_path / "f", writer="demo", overwrite=True)


@pytest.mark.parametrize("mask", [0o022, 0o002, 0o077])
def test_outputs_get_the_modes_of_plain_files_under_the_umask(tmp_path, mask):
    from flowalign.io import atomic_path

    previous = os.umask(mask)
    try:
        with atomic_path(tmp_path / "f.txt") as tmp:
            tmp.write_text("x")
        _write(tmp_path / "new", {"x.txt": "1"})
    finally:
        os.umask(previous)
    assert stat.S_IMODE((tmp_path / "f.txt").stat().st_mode) == 0o666 & ~mask
    assert stat.S_IMODE((tmp_path / "new").stat().st_mode) == 0o777 & ~mask
    (tmp_path / "f.txt").chmod(0o640)
    with atomic_path(tmp_path / "f.txt") as tmp:  # a replaced file keeps its own mode
        tmp.write_text("y")
    assert stat.S_IMODE((tmp_path / "f.txt").stat().st_mode) == 0o640


def test_temporaries_of_a_killed_writer_are_swept_and_a_live_ones_kept(tmp_path):
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale, live = tmp_path / f".out.tmp-{dead.pid}-abc", tmp_path / f".out.tmp-{os.getpid()}-xyz"
    stale.mkdir()
    (stale / "half.bin").write_text("x")
    live.mkdir()
    (tmp_path / f".f.txt.tmp-{dead.pid}-q.txt").write_text("torn")
    _write(tmp_path / "out", {"x.txt": "1"})
    from flowalign.io import atomic_path

    with atomic_path(tmp_path / "f.txt") as tmp:
        tmp.write_text("whole")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["out", "f.txt", live.name])


def test_overwrite_keeps_a_users_files_inside_a_folder_of_a_name_it_writes(tmp_path):
    (tmp_path / "media").mkdir()
    (tmp_path / "media" / "photo.jpg").write_text("holiday")
    (tmp_path / "index.html").write_text("mine")
    with pytest.raises(UserError, match="--overwrite"):
        _write(tmp_path, {"index.html": "gallery"})
    with atomic_dir(tmp_path, writer="demo", overwrite=True) as tmp:
        (tmp / "index.html").write_text("gallery")
        (tmp / "media" / "c00").mkdir(parents=True)
        (tmp / "media" / "c00" / "0.png").write_text("sample")
    assert (tmp_path / "media" / "photo.jpg").read_text() == "holiday"
    assert (tmp_path / "media" / "c00" / "0.png").read_text() == "sample"
    assert (tmp_path / "index.html").read_text() == "gallery"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".flowalign-") and p.is_dir()]


@pytest.mark.parametrize("mask", [0o022, 0o027])
def test_safetensors_outputs_follow_the_umask_like_the_json_beside_them(tmp_path, mask):
    """safetensors replaces the file it writes by a private (0600) one: every writer of outputs gives it back
    the umask's mode, as the JSON beside it has."""
    import torch
    from safetensors.torch import save_file

    from flowalign import checkpoint as ckpt
    from flowalign.io import atomic_path, write_json

    tensors = {"w": torch.zeros(2)}
    previous = os.umask(mask)
    try:
        with atomic_path(tmp_path / "one.safetensors") as tmp:
            save_file(tensors, str(tmp))
        for folder in (tmp_path / "new", tmp_path / "new"):  # a new folder, then one written before
            with atomic_dir(folder, writer="demo") as out:
                save_file(tensors, str(out / "w.safetensors"))
                write_json(out / "meta.json", {})
        ckpt_tmp = tmp_path / "run" / "checkpoints" / ".tmp-step-000001"
        ckpt_tmp.mkdir(parents=True)
        ckpt.write_checkpoint_files(ckpt_tmp, trainable=tensors, optimizer=None, ema_state=tensors, trainer_state={})
        ckpt.finalise(ckpt_tmp, tmp_path / "run" / "checkpoints" / "step-000001")
    finally:
        os.umask(previous)
    written = [tmp_path / "one.safetensors", tmp_path / "new" / "w.safetensors",
               *(tmp_path / "run" / "checkpoints" / "step-000001").glob("*.safetensors")]
    assert len(written) == 4
    assert {stat.S_IMODE(p.stat().st_mode) for p in written} == {0o666 & ~mask}
    assert stat.S_IMODE((tmp_path / "new" / "meta.json").stat().st_mode) == 0o666 & ~mask
    from flowalign.checkpoint_manifest import damage

    assert damage(tmp_path / "run" / "checkpoints" / "step-000001") is None  # the manifest holds as written
