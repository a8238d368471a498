"""Bad inputs and faults end in one ``error: ...`` line (exit 2), never a traceback, and leave nothing
behind that blocks the corrected rerun."""

import errno
import json
import shutil

import pytest
import torch

from flowalign import checkpoint as ckpt
from flowalign.checkpoint_manifest import MANIFEST, damage
from flowalign.cli.main import main
from flowalign.protocols import RewardOutput
from tests.flowalign.trainers.conftest import prompt_file, small_run  # noqa: F401 (a fixture)

HERE = "tests.flowalign.cli.test_clear_errors"


def scalar_reward(samples, prompts, metadata):
    return 0.5


def too_many_reward(samples, prompts, metadata):
    return torch.zeros(len(prompts) + 3)


def two_column_reward(samples, prompts, metadata):
    return torch.zeros(len(prompts), 2)


class FloatReward:
    name, differentiable = "float_reward", False

    def __call__(self, samples, prompts, metadata):
        return 1.0


class UnmaskedReward:
    name, differentiable = "unmasked", False

    def __call__(self, samples, prompts, metadata):
        return RewardOutput({"x": torch.zeros(len(prompts))}, valid=torch.ones(1, dtype=torch.bool))


def one_line_error(argv, capsys, *needles):
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err, err
    err = err.strip().splitlines()[-1]  # after any progress bars of the model loading
    assert err.startswith("error: "), err
    for needle in needles:
        assert needle in err, err
    return err


def train_args(run_dir, model, prompts, *extra):
    return ["train", "/dev/null", *small_run(run_dir, model, prompts, *extra)]


@pytest.mark.parametrize("reward,needles", [
    ("scalar_reward", ["'scalar_reward' as a tensor of shape (1,) for 8 samples", "expected a RewardOutput"]),
    ("too_many_reward", ["shape (11,) for 8 samples"]),
    ("two_column_reward", ["shape (16,) for 8 samples"]),
    ("FloatReward", ["returned a float", "expected a RewardOutput with (8,) float components"]),
    ("UnmaskedReward", ["'valid' as a tensor of shape (1,) for 8 samples"]),
])
def test_a_reward_of_the_wrong_shape_or_type(reward, needles, tmp_path, capsys, tiny_sd3_dir, prompt_file):
    # rewards score each rollout batch: one batch of all 8 samples (2 prompts x 4)
    one_line_error(train_args(tmp_path / "r", tiny_sd3_dir, prompt_file, f"rewards=[{{name: '{HERE}:{reward}'}}]",
                              "trainer.max_steps=1", "trainer.batch_size=8"), capsys, *needles)


def test_an_unknown_reward_option(tmp_path, capsys, tiny_sd3_dir, prompt_file):
    one_line_error(train_args(tmp_path / "r", tiny_sd3_dir, prompt_file, "rewards=[{name: vvr, gama: 0.5}]"), capsys,
                   "reward 'vvr' has no option 'gama'", "gamma")


def test_vvr_with_plain_text_prompts(tmp_path, capsys, tiny_sd3_dir, prompt_file):
    one_line_error(train_args(tmp_path / "r", tiny_sd3_dir, prompt_file, "rewards=[{name: vvr}]"), capsys,
                   "carry no 'task'", "plain text prompts")
    one_line_error(["gallery", "--model", tiny_sd3_dir, "--prompts", prompt_file, "--reward", "vvr", "--out",
                    tmp_path / "g"], capsys, "carry no 'task'")
    assert not (tmp_path / "g").exists()


def test_unreadable_config_and_prompt_files(tmp_path, capsys, tiny_sd3_dir, prompt_file):
    latin = tmp_path / "latin.yaml"
    latin.write_bytes("run:\n  name: caf\xe9\n".encode("latin-1"))
    one_line_error(["train", latin], capsys, "not UTF-8", "byte 0xe9")
    (tmp_path / "p.txt").write_bytes(b"a red \xff circle\n")
    one_line_error(train_args(tmp_path / "r", tiny_sd3_dir, tmp_path / "p.txt"), capsys, "prompt file", "not UTF-8")
    one_line_error(["gallery", "--model", tiny_sd3_dir, "--prompts", tmp_path / "p.txt", "--out", tmp_path / "g"], capsys,
                   "--prompts", "not UTF-8")
    one_line_error(train_args(tmp_path / "r", tiny_sd3_dir, tmp_path), capsys, "is a folder, not a file")
    one_line_error(["train", tmp_path], capsys, "config file", "is a folder")
    one_line_error(["train", "/dev/null", "trainer.lr=[1,"], capsys, "override trainer.lr", "not valid YAML")
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("argv,needle", [
    (["evaluate", "--batch-size", "0", "--out", "o"], "--batch-size 0: give an integer >= 1"),
    (["evaluate", "--steps", "0", "--out", "o"], "--steps 0: give an integer >= 1 (leave it out for the default)"),
    (["evaluate", "--n", "0", "--out", "o"], "--n 0"),
    (["sample", "--prompt", "p", "--steps", "0", "--out", "x.png"], "--steps 0"),
    (["gallery", "--evals", "e", "--batch-size", "-1", "--out", "g"], "--batch-size -1"),
])
def test_zero_is_not_a_default(argv, needle, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    one_line_error(argv, capsys, needle)
    assert list(tmp_path.iterdir()) == []


def test_unwritable_output_folders(tmp_path, capsys, tiny_sd3_dir, prompt_file):
    one_line_error(["evaluate", "--n", "1", "--out", "/proc/flowalign-test/e"], capsys, "cannot write there")
    one_line_error(["evaluate", "--n", "1", "--out", "/sys/flowalign-test"], capsys, "cannot write there")
    one_line_error(["tiny", "sd3", "--out", "/proc/flowalign-test/m"], capsys, "No such file or directory")
    one_line_error(["gallery", "--evals", tmp_path, "--out", "/proc/g"], capsys, "cannot write there")
    one_line_error(train_args("/proc/flowalign-test/r", tiny_sd3_dir, prompt_file), capsys,
                   "run.output_dir /proc/flowalign-test/r: cannot create it")


@pytest.fixture(scope="module")
def lora_checkpoint(tmp_path_factory, tiny_sd3_dir, prompt_file):
    run_dir = tmp_path_factory.mktemp("lora") / "r"
    assert main(train_args(run_dir, tiny_sd3_dir, prompt_file, "trainer.max_steps=1")) == 0
    return ckpt.latest_checkpoint(run_dir)


def test_bad_adapters(tmp_path, capsys, tiny_sd3_dir, lora_checkpoint):
    sample = ["sample", "--model", tiny_sd3_dir, "--prompt", "p", "--steps", "2", "--out", tmp_path / "x.png"]
    (tmp_path / "random.safetensors").write_bytes(torch.randint(0, 255, (999,), dtype=torch.uint8).numpy().tobytes())
    one_line_error([*sample, "--adapter", tmp_path / "random.safetensors"], capsys, "cannot read its weights")
    truncated = shutil.copytree(lora_checkpoint, tmp_path / "truncated")
    lora = truncated / "pytorch_lora_weights.safetensors"
    lora.write_bytes(lora.read_bytes()[:200])
    one_line_error([*sample, "--adapter", truncated], capsys, "damaged", "pytorch_lora_weights.safetensors has 200 bytes")
    (truncated / MANIFEST).unlink()  # a checkpoint from before manifests
    one_line_error([*sample, "--adapter", truncated], capsys, "cannot read its weights")
    missing = shutil.copytree(lora_checkpoint, tmp_path / "missing")
    (missing / "pytorch_lora_weights.safetensors").unlink()
    one_line_error([*sample, "--adapter", missing], capsys, "pytorch_lora_weights.safetensors is missing")
    (missing / MANIFEST).unlink()
    err = one_line_error([*sample, "--adapter", missing], capsys, "LoRA checkpoint is missing its LoRA file")
    assert "unknown tensors" not in err
    assert not (tmp_path / "x.png").exists()


def test_a_full_disk_keeps_the_last_checkpoint_and_says_what_one_needs(tmp_path, capsys, tiny_sd3_dir, prompt_file,
                                                                       monkeypatch):
    writes = {"n": 0}
    real = ckpt.save_file

    def fills_up(tensors, path, *a, **kw):
        writes["n"] += 1
        if "step-000002" in str(path):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(tensors, path, *a, **kw)

    monkeypatch.setattr(ckpt, "save_file", fills_up)
    args = train_args(tmp_path / "r", tiny_sd3_dir, prompt_file, "run.checkpoint_every=1")
    err = one_line_error(args, capsys, "no space left", "a checkpoint needs about", "step-000001 is complete")
    size = sum(p.stat().st_size for p in (tmp_path / "r" / "checkpoints" / "step-000001").rglob("*") if p.is_file())
    assert f"{size / 1024:.1f} KB" in err
    assert [p.name for p in (tmp_path / "r" / "checkpoints").iterdir()] == ["step-000001"]  # no half-written one
    assert damage(tmp_path / "r" / "checkpoints" / "step-000001") is None
    monkeypatch.setattr(ckpt, "save_file", real)
    assert main([str(a) for a in args]) == 0  # space freed: it resumes
    assert "resumed from" in capsys.readouterr().out


def test_a_failed_start_leaves_nothing_that_blocks_the_rerun(tmp_path, capsys, tiny_sd3_dir, prompt_file):
    run_dir = tmp_path / "r"
    one_line_error(train_args(run_dir, tmp_path / "no-model", prompt_file), capsys)
    one_line_error(train_args(run_dir, tiny_sd3_dir, prompt_file, "rewards=[{name: no_such_reward}]"), capsys,
                   "unknown reward")
    assert not (run_dir / "config.yaml").exists()
    assert main([str(a) for a in train_args(run_dir, tiny_sd3_dir, prompt_file, "trainer.max_steps=1")]) == 0


def test_moved_runs_resume_and_finished_runs_are_not_rerun(tmp_path, capsys, tiny_sd3_dir, prompt_file):
    evaluation = ["eval.bench=vvr", "eval.level=easy", "eval.n=1", "eval.num_steps=2", "eval.gallery=false"]
    first = tmp_path / "first"
    assert main([str(a) for a in train_args(first, tiny_sd3_dir, prompt_file, "trainer.max_steps=1", *evaluation)]) == 0
    moved = tmp_path / "moved"
    first.rename(moved)
    assert main([str(a) for a in train_args(moved, tiny_sd3_dir, prompt_file, "trainer.max_steps=2", *evaluation)]) == 0
    assert "resumed from" in capsys.readouterr().out
    rows = (moved / "metrics.jsonl").read_text()
    steps = [(r["step"], "eval/n" in r) for r in map(json.loads, rows.splitlines())]
    assert steps == [(0, True), (1, False), (1, True), (2, False), (2, True)]
    newest = ckpt.latest_checkpoint(moved)
    stamp = (newest / "COMPLETE").stat().st_mtime_ns
    assert main([str(a) for a in train_args(moved, tiny_sd3_dir, prompt_file, "trainer.max_steps=2", *evaluation)]) == 0
    assert "already finished" in capsys.readouterr().out
    assert (moved / "metrics.jsonl").read_text() == rows and (newest / "COMPLETE").stat().st_mtime_ns == stamp
    assert main([str(a) for a in train_args(moved, tiny_sd3_dir, prompt_file, "trainer.max_steps=2", "trainer.lr=1")]) == 2
    assert "another run's config" in capsys.readouterr().err  # a finished run still refuses a different config
