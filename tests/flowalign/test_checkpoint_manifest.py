"""Damaged checkpoints: each carries a manifest of sizes and checksums; ``resume: auto`` skips a damaged
newest checkpoint (saying which and why) and continues from the newest whole one."""

import json
import shutil

import pytest
from safetensors.torch import load_file

from flowalign import checkpoint as ckpt
from flowalign.checkpoint_manifest import MANIFEST, damage, resume_folder
from flowalign.errors import UserError
from flowalign.logger import RunLogger
from flowalign.train import train
from tests.flowalign.trainers.conftest import prompt_file, small_config  # noqa: F401 (a fixture)


@pytest.fixture(scope="module")
def finished(tmp_path_factory, tiny_sd3_dir, prompt_file):
    """A 3-step run with a checkpoint after every step."""
    run_dir = tmp_path_factory.mktemp("run") / "r"
    train(small_config(run_dir, tiny_sd3_dir, prompt_file, "trainer.max_steps=3", "run.checkpoint_every=1",
                       "run.keep_checkpoints=5"))
    return run_dir


def _truncate(f):
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


DAMAGES = {
    "truncated weights": lambda d: _truncate(d / "trainable.safetensors"),
    "zero-byte adapter": lambda d: (d / "pytorch_lora_weights.safetensors").write_bytes(b""),
    "missing optimizer": lambda d: (d / "optimizer.safetensors").unlink(),
    "missing rng": lambda d: (d / "rng-rank0.safetensors").unlink(),
    "corrupt trainer state": lambda d: (d / "trainer_state.json").write_text('{"step": 3, "world_si'),
    "flipped byte": lambda d: (d / "optimizer.safetensors").write_bytes(
        (d / "optimizer.safetensors").read_bytes()[:-1] + b"\x00"),
}


def test_every_file_is_in_the_manifest(finished):
    folder = ckpt.latest_checkpoint(finished)
    listed = json.loads((folder / MANIFEST).read_text())["files"]
    on_disk = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}
    assert set(listed) == on_disk - {MANIFEST, ckpt.COMPLETE}
    assert {"trainable.safetensors", "optimizer.safetensors", "rng-rank0.safetensors", "trainer_state.json"} <= set(listed)
    assert damage(folder) is None


@pytest.mark.parametrize("name", list(DAMAGES))
def test_auto_resume_skips_a_damaged_newest_checkpoint(name, finished, tmp_path, capsys):
    run_dir = shutil.copytree(finished, tmp_path / "r")
    DAMAGES[name](run_dir / "checkpoints" / "step-000003")
    assert damage(run_dir / "checkpoints" / "step-000003") is not None
    folder = resume_folder(run_dir, "auto", main=True)
    assert folder == run_dir / "checkpoints" / "step-000002"
    err = capsys.readouterr().err
    assert "skipping checkpoint step-000003" in err and len(err.strip().splitlines()) == 1
    assert (run_dir / "checkpoints" / "step-000003.damaged").is_dir()  # kept, never resumed or pruned
    assert ckpt.latest_checkpoint(run_dir) == folder
    with pytest.raises(UserError, match="damaged"):
        DAMAGES[name](folder)
        resume_folder(run_dir, str(folder), main=True)


def test_a_step_damaged_a_second_time_is_kept_beside_the_first(finished, tmp_path, capsys):
    run_dir = shutil.copytree(finished, tmp_path / "r")
    checkpoints = run_dir / "checkpoints"
    for i in range(3):  # damaged, redone by the resumed run, damaged again
        if i:
            shutil.copytree(finished / "checkpoints" / "step-000003", checkpoints / "step-000003")
        _truncate(checkpoints / "step-000003" / "trainable.safetensors")
        assert resume_folder(run_dir, "auto", main=True) == checkpoints / "step-000002"
    assert sorted(p.name for p in checkpoints.glob("step-000003*")) == [
        "step-000003.damaged", "step-000003.damaged-2", "step-000003.damaged-3"]
    assert "kept as step-000003.damaged-3" in capsys.readouterr().err


def test_checkpoints_without_a_manifest_still_resume_unless_they_do_not_load(finished, tmp_path, capsys):
    run_dir = shutil.copytree(finished, tmp_path / "r")
    for folder in ckpt.list_checkpoints(run_dir):
        (folder / MANIFEST).unlink()
    assert resume_folder(run_dir, "auto", main=True).name == "step-000003"
    _truncate(run_dir / "checkpoints" / "step-000003" / "trainable.safetensors")
    assert resume_folder(run_dir, "auto", main=True).name == "step-000002"
    assert "does not load" in capsys.readouterr().err


def test_resumed_past_a_damaged_checkpoint_ends_at_the_same_weights(finished, tmp_path, tiny_sd3_dir, prompt_file, capsys):
    run_dir = shutil.copytree(finished, tmp_path / "r")
    _truncate(run_dir / "checkpoints" / "step-000003" / "trainable.safetensors")
    rows = (run_dir / "metrics.jsonl").read_text()
    (run_dir / "metrics.jsonl").write_text(rows + rows.splitlines()[-1][:17])  # a row torn by a kill
    train(small_config(run_dir, tiny_sd3_dir, prompt_file, "trainer.max_steps=3", "run.checkpoint_every=1",
                       "run.keep_checkpoints=5"))
    out = capsys.readouterr()
    assert "resumed from" in out.out and "step-000002" in out.out
    assert "skipping checkpoint step-000003" in out.err and "torn row" in out.err
    a = load_file(str(finished / "checkpoints" / "step-000003" / "trainable.safetensors"))
    b = load_file(str(run_dir / "checkpoints" / "step-000003" / "trainable.safetensors"))
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]


def test_a_torn_last_metrics_row_is_dropped_with_a_warning(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "a": 1}\n{"step": 2, "a": 2}\n{"step": 3, "a"')
    logger = RunLogger(tmp_path, enabled=True, tensorboard=False, wandb=False, project="p", name="n", config={})
    logger.truncate_after(5)
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1, "a": 1}\n{"step": 2, "a": 2}\n'
    assert "metrics.jsonl:3 is a torn row" in capsys.readouterr().err


def test_a_run_folder_resolves_to_its_newest_whole_checkpoint_and_any_other_folder_to_itself(tmp_path):
    from flowalign.checkpoint import COMPLETE
    from flowalign.checkpoint_manifest import resolve_checkpoint
    from flowalign.manifest import write_manifest

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    assert resolve_checkpoint(run) is None  # a run without a checkpoint yet
    for step in (1, 2):
        folder = run / "checkpoints" / f"step-{step:06d}"
        folder.mkdir()
        (folder / "trainable.safetensors").write_bytes(b"weights %d" % step)
        write_manifest(folder, skip={COMPLETE})
        (folder / COMPLETE).write_text("ok\n")
    assert resolve_checkpoint(run) == run / "checkpoints" / "step-000002"
    (run / "checkpoints" / "step-000002" / "trainable.safetensors").write_bytes(b"torn")
    assert resolve_checkpoint(run) == run / "checkpoints" / "step-000001"  # the damaged newest is passed over
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    assert resolve_checkpoint(adapter) == adapter
