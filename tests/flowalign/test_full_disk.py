"""A full disk while writing a checkpoint, on a real small file system (the writers' own errors, not
stand-ins): one line naming the folder and the space needed, no temporary left behind, the lock released."""

from flowalign.cli.main import main
from tests.flowalign.trainers.conftest import prompt_file, small_run  # noqa: F401 (a fixture)


def _error(err):
    """The one error line (loading progress bars aside), and no traceback."""
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, err
    return lines[0]


def _leftovers(folder):
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if ".tmp-" in p.name or ".partial" in p.name)


def test_train_on_a_full_disk_says_what_a_checkpoint_needs(small_disk, tiny_sd3_dir, prompt_file, capsys):
    disk = small_disk(80)  # the run's small files fit, a checkpoint (~120 KB) does not
    run_dir = disk / "r"
    code = main(["train", "/dev/null", *small_run(run_dir, tiny_sd3_dir, prompt_file, "trainer.max_steps=1",
                                                   "run.checkpoint_every=1")])
    err = capsys.readouterr().err
    assert code == 2, err
    line = _error(err)
    assert line.startswith(f"error: no space left on the device of {run_dir}")
    assert "a checkpoint needs about" in line and "no checkpoint was written yet" in line
    assert _leftovers(run_dir) == [] and not (run_dir / "train.lock").exists()


def test_train_reward_on_a_full_disk_names_its_folder(small_disk, tiny_sd3_dir, tmp_path, capsys):
    import json

    import numpy as np
    from PIL import Image

    rows = []
    for i in range(4):
        for name, colour in (("good", (230, 30, 30)), ("bad", (30, 30, 230))):
            Image.fromarray(np.full((32, 32, 3), colour, np.uint8)).save(tmp_path / f"{name}{i}.png")
        rows.append({"prompt": f"p{i % 2}", "chosen": f"good{i}.png", "rejected": f"bad{i}.png"})
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    disk = small_disk(8)
    code = main(["train-reward", "--model", str(tiny_sd3_dir), "--pairs", str(tmp_path / "pairs.jsonl"),
                 "--registers", "2", "--head-hidden", "8", "--train-steps", "2", "--batch-size", "2", "--no-progress",
                 "--out", str(disk / "reward")])
    err = capsys.readouterr().err
    assert code == 2, err
    line = _error(err)
    assert f"no space left on the device of {disk / 'reward.partial'}" in line and "it needs about" in line
    assert sorted(p.name for p in disk.iterdir()) == []  # the temporary folder went


def test_tiny_on_a_full_disk_names_its_folder_and_leaves_it_as_it_was(small_disk, capsys):
    disk = small_disk(100)  # the tiny SD3 folder (~1 MB of safetensors) does not fit
    (disk / "m").mkdir()
    (disk / "m" / "notes.txt").write_text("a user's file")
    code = main(["tiny", "sd3", "--out", str(disk / "m"), "--overwrite"])
    err = capsys.readouterr().err
    assert code == 2, err
    line = _error(err)
    assert f"no space left on the device of {disk / 'm'} (writing the tiny sd3 model)" in line
    assert "it needs about" in line and "MB free" in line
    assert sorted(str(p.relative_to(disk)) for p in disk.rglob("*")) == ["m", "m/notes.txt"]  # no temporary left


def test_the_full_disk_line_reads_whole_before_and_after_the_first_checkpoint(tmp_path):
    import errno

    import pytest
    import torch

    from flowalign import checkpoint as ckpt
    from flowalign.disk_space import explain_full_disk
    from flowalign.errors import UserError

    params = [torch.zeros(256)]
    with pytest.raises(UserError) as none_yet, explain_full_disk(tmp_path, params, keep=2):
        raise OSError(errno.ENOSPC, "No space left on device")
    assert str(none_yet.value).endswith("; no checkpoint was written yet, so once space is freed the rerun starts over")
    done = tmp_path / "checkpoints" / "step-000003"
    done.mkdir(parents=True)
    (done / ckpt.COMPLETE).write_text("ok\n")
    with pytest.raises(UserError) as kept, explain_full_disk(tmp_path, params, keep=2):
        raise OSError(errno.ENOSPC, "No space left on device")
    assert str(kept.value).endswith(f"; {done} is complete and the run resumes from it once space is freed")
