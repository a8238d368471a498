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


def _snapshot(folder):
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_tiny_refuses_a_model_folder_it_did_not_write(tmp_path, capsys, tiny_sd3_dir):
    import shutil

    weights = shutil.copytree(tiny_sd3_dir, tmp_path / "m")  # another model's folder (flowalign.json and all)
    before = _snapshot(weights)
    code, _, err = run(["tiny", "sd3", "--out", weights], capsys)
    assert code == 2 and str(weights) in err and "--overwrite" in err and len(err.strip().splitlines()) == 1
    assert _snapshot(weights) == before
    model = _with_sentinel(tmp_path / "model")
    assert run(["tiny", "sd3", "--out", model], capsys)[0] == 2
    assert run(["tiny", "sd3", "--out", model, "--overwrite"], capsys)[0] == 0
    assert _sentinel_intact(model) and (model / "model_index.json").is_file()
    assert run(["tiny", "sd3", "--out", model, "--seed", "1"], capsys)[0] == 0  # its own folder: no question


def test_sample_refuses_an_existing_file_and_keeps_its_mode(tmp_path, capsys, tiny_sd3_dir):
    import stat

    photo = tmp_path / "holiday.png"
    photo.write_bytes(b"a photo")
    photo.chmod(0o644)
    argv = ["sample", "--model", tiny_sd3_dir, "--prompt", "p", "--steps", "2", "--out", photo]
    code, _, err = run(argv, capsys)
    assert code == 2 and str(photo) in err and "--overwrite" in err and len(err.strip().splitlines()) == 1
    assert photo.read_bytes() == b"a photo"
    assert run([*argv, "--overwrite"], capsys)[0] == 0
    assert photo.read_bytes() != b"a photo" and stat.S_IMODE(photo.stat().st_mode) == 0o644


def test_train_refuses_a_folder_of_user_files_and_overwrite_keeps_them(tmp_path, capsys, tiny_sd3_dir):
    from tests.flowalign.trainers.conftest import small_run

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle\n")
    run_dir = tmp_path / "photos"
    for name in ("metrics.jsonl", "gallery/index.html", "gallery/media/photo.jpg",
                 "evals/step-000001/samples/00000.png"):
        (run_dir / name).parent.mkdir(parents=True, exist_ok=True)
        (run_dir / name).write_text(f"user's {name}")
    before = _snapshot(run_dir)
    argv = ["train", "/dev/null", *small_run(run_dir, tiny_sd3_dir, prompts, "trainer.max_steps=1")]
    code, _, err = run(argv, capsys)
    assert code == 2 and f"run.output_dir {run_dir}" in err and "--overwrite" in err
    assert len(err.strip().splitlines()) == 1
    assert _snapshot(run_dir) == before and not (run_dir / "train.lock").exists()
    code, _, err = run([*argv, "--overwrite"], capsys)
    assert code == 0, err
    assert (run_dir / "checkpoints" / "step-000001" / "COMPLETE").is_file()
    after = _snapshot(run_dir)
    assert {k: after[k] for k in before if k != "metrics.jsonl"} == {k: v for k, v in before.items() if k != "metrics.jsonl"}
    code, out, err = run([*argv[:-1], "trainer.max_steps=2"], capsys)  # the run's own folder now: resumed
    assert code == 0 and "resumed from" in out, err
    assert (run_dir / "checkpoints" / "step-000002" / "COMPLETE").is_file()


def test_gallery_of_a_run_keeps_user_files_in_its_gallery_folder(tmp_path, capsys, evaluation):
    import shutil

    run_dir = tmp_path / "r"
    shutil.copytree(evaluation, run_dir / "evals" / "step-000001")
    (run_dir / "gallery" / "media").mkdir(parents=True)
    (run_dir / "gallery" / "media" / "photo.jpg").write_text("holiday")
    code, _, err = run(["gallery", "--run", run_dir], capsys)
    assert code == 2 and "--overwrite" in err and "media" in err
    assert sorted(p.name for p in (run_dir / "gallery" / "media").iterdir()) == ["photo.jpg"]
    assert run(["gallery", "--run", run_dir, "--overwrite"], capsys)[0] == 0
    assert (run_dir / "gallery" / "media" / "photo.jpg").read_text() == "holiday"
    assert (run_dir / "gallery" / "index.html").is_file()
    assert run(["gallery", "--run", run_dir], capsys)[0] == 2  # media/ is still the user's folder
    assert run(["gallery", "--run", run_dir, "--overwrite"], capsys)[0] == 0
    assert (run_dir / "gallery" / "media" / "photo.jpg").read_text() == "holiday"


@pytest.mark.parametrize("text", ["hello: world\n", "just some notes\n", "a: [\n", "trainer:\n  name: flow_grpo\n"])
@pytest.mark.parametrize("overwrite", [False, True])
def test_train_refuses_a_config_yaml_no_run_wrote(tmp_path, capsys, tiny_sd3_dir, text, overwrite):
    """A user's own config.yaml (notes, broken YAML, a partial config) does not make a folder a run's:
    one line naming the file, and the folder stays exactly as it was (no marker, no lock)."""
    from tests.flowalign.trainers.conftest import small_run

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle\n")
    run_dir = tmp_path / "project"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(text)
    (run_dir / "photo.jpg").write_text("holiday")
    argv = ["train", "/dev/null", *small_run(run_dir, tiny_sd3_dir, prompts, "trainer.max_steps=1")]
    code, _, err = run([*argv, *(["--overwrite"] if overwrite else [])], capsys)
    assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert f"run.output_dir {run_dir}" in err and "config.yaml" in err
    assert sorted(p.name for p in run_dir.iterdir()) == ["config.yaml", "photo.jpg"]
    assert (run_dir / "config.yaml").read_text() == text


def test_train_reward_refuses_an_existing_pairs_out_file_before_sampling(tmp_path, capsys, tiny_sd3_dir):
    kept = tmp_path / "pairs.safetensors"
    kept.write_bytes(b"user data")
    argv = ["train-reward", "--model", tiny_sd3_dir, "--bench", "vvr", "--level", "easy", "--n", "2", "--group-size", "2",
            "--steps", "2", "--registers", "2", "--head-hidden", "8", "--train-steps", "2", "--batch-size", "2",
            "--no-progress", "--pairs-out", kept, "--out", tmp_path / "r"]
    code, _, err = run(argv, capsys)
    assert code == 2 and "--pairs-out" in err and "--overwrite" in err and len(err.strip().splitlines()) == 1
    assert kept.read_bytes() == b"user data" and not (tmp_path / "r").exists()
