"""Every command that writes an output folder keeps the files it did not write: a sentinel file in the
target survives, a folder the command never wrote to is refused without ``--overwrite``, and a rerun
replaces only its own earlier output."""

import json

import numpy as np
import pytest
from PIL import Image

from flowalign.cli.main import main

SENTINEL = "keep-me.txt"


def run(argv, capsys):
    code = main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def _with_sentinel(folder):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / SENTINEL).write_text("user data")
    return folder


def _sentinel_intact(folder):
    return (folder / SENTINEL).read_text() == "user data"


@pytest.fixture(scope="module")
def evaluation(tmp_path_factory, tiny_sd3_dir):
    out = tmp_path_factory.mktemp("eval") / "e"
    assert main(["evaluate", "--model", str(tiny_sd3_dir), "--level", "easy", "--n", "2", "--steps", "2",
                 "--out", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def pairs_file(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pairs")
    rows = []
    for i in range(4):
        for name, colour in (("good", (230, 30, 30)), ("bad", (30, 30, 230))):
            Image.fromarray(np.full((32, 32, 3), colour, np.uint8)).save(folder / f"{name}{i}.png")
        rows.append({"prompt": f"p{i % 2}", "chosen": f"good{i}.png", "rejected": f"bad{i}.png"})
    (folder / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder / "pairs.jsonl"


def _commands(tiny_sd3_dir, evaluation, pairs_file, prompts):
    """Each command (with its arguments but ``--out``) that writes a folder, and a file it writes there."""
    return {
        "gallery --evals": (["gallery", "--evals", evaluation], "index.html"),
        "gallery --model": (["gallery", "--model", tiny_sd3_dir, "--prompts", prompts, "--steps", "2"], "index.html"),
        "evaluate": (["evaluate", "--model", tiny_sd3_dir, "--level", "easy", "--n", "1", "--steps", "2"],
                     "metrics.json"),
        "train-reward": (["train-reward", "--model", tiny_sd3_dir, "--pairs", pairs_file, "--registers", "2",
                          "--head-hidden", "8", "--train-steps", "2", "--batch-size", "2", "--no-progress"],
                         "registers.safetensors"),
    }


@pytest.mark.parametrize("name", ["gallery --evals", "gallery --model", "evaluate", "train-reward"])
def test_refused_without_overwrite_then_only_own_files_replaced(name, tmp_path, capsys, tiny_sd3_dir, evaluation,
                                                                 pairs_file):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle\n")
    argv, written = _commands(tiny_sd3_dir, evaluation, pairs_file, prompts)[name]
    out = _with_sentinel(tmp_path / "notes")
    code, _, err = run([*argv, "--out", out], capsys)
    assert code == 2 and "--overwrite" in err and SENTINEL in err and len(err.strip().splitlines()) == 1
    assert sorted(p.name for p in out.iterdir()) == [SENTINEL]
    code, _, err = run([*argv, "--out", out, "--overwrite"], capsys)
    assert code == 0, err
    assert _sentinel_intact(out) and (out / written).is_file()
    first = (out / written).stat().st_mtime_ns
    code, _, err = run([*argv, "--out", out], capsys)  # its own earlier output: replaced without asking
    assert code == 0, err
    assert _sentinel_intact(out) and (out / written).stat().st_mtime_ns >= first
    assert not [p for p in out.iterdir() if p.name.startswith((".flowalign-tmp-", ".flowalign-old-", ".notes."))]


def test_out_dot_and_a_run_folder_lose_nothing(tmp_path, capsys, evaluation, monkeypatch):
    run_dir = _with_sentinel(tmp_path / "runs" / "r")
    (run_dir / "checkpoints" / "step-000001").mkdir(parents=True)
    (run_dir / "checkpoints" / "step-000001" / "COMPLETE").write_text("ok\n")
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    before = sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*"))
    assert run(["gallery", "--evals", evaluation, "--out", run_dir], capsys)[0] == 2
    assert sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*")) == before
    assert run(["gallery", "--evals", evaluation, "--out", run_dir, "--overwrite"], capsys)[0] == 0
    assert set(before) <= {str(p.relative_to(run_dir)) for p in run_dir.rglob("*")}

    monkeypatch.chdir(_with_sentinel(tmp_path / "cwd"))
    code, _, err = run(["gallery", "--evals", evaluation, "--out", "."], capsys)
    assert code == 2 and "--overwrite" in err
    assert run(["gallery", "--evals", evaluation, "--out", ".", "--overwrite"], capsys)[0] == 0
    assert _sentinel_intact(tmp_path / "cwd") and (tmp_path / "cwd" / "index.html").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cwd", "runs"]  # nothing written beside it


def test_tiny_sample_and_train_keep_a_sentinel(tmp_path, capsys, tiny_sd3_dir):
    model = _with_sentinel(tmp_path / "model")
    assert run(["tiny", "sd3", "--out", model], capsys)[0] == 0
    assert _sentinel_intact(model) and (model / "model_index.json").is_file()
    pics = _with_sentinel(tmp_path / "pics")
    assert run(["sample", "--model", tiny_sd3_dir, "--prompt", "p", "--steps", "2", "--out", pics / "a.png"], capsys)[0] == 0
    assert _sentinel_intact(pics) and (pics / "a.png").is_file()
    from tests.flowalign.trainers.conftest import small_run

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle\n")
    run_dir = _with_sentinel(tmp_path / "run")
    code, _, err = run(["train", "/dev/null", *small_run(run_dir, tiny_sd3_dir, prompts, "trainer.max_steps=1")], capsys)
    assert code == 0, err
    assert _sentinel_intact(run_dir) and (run_dir / "checkpoints" / "step-000001" / "COMPLETE").is_file()
