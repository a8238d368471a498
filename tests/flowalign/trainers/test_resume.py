"""A run killed with SIGKILL and resumed ends bit-identical to an uninterrupted run (CPU, same seed)."""

import signal
import time

from safetensors.torch import load_file

from .conftest import run_cli, small_run


def _finish(proc, timeout=240):
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out
    return out


def test_sigkill_then_resume_is_bit_identical(tmp_path, tiny_sd3_dir, prompt_file):
    args = lambda d: ["train", "/dev/null", *small_run(d, tiny_sd3_dir, prompt_file, "trainer.max_steps=4",
                                                      "run.checkpoint_every=1", "run.keep_checkpoints=5")]
    reference = tmp_path / "uninterrupted"
    _finish(run_cli(args(reference)))

    killed = tmp_path / "killed"
    proc = run_cli(args(killed))
    marker = killed / "checkpoints" / "step-000002" / "COMPLETE"
    deadline = time.time() + 240
    while not marker.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (killed / "checkpoints" / "step-000004").exists(), "the run finished before it could be killed"

    out = _finish(run_cli(args(killed)))
    assert "resumed from" in out
    a = load_file(str(reference / "checkpoints" / "step-000004" / "trainable.safetensors"))
    b = load_file(str(killed / "checkpoints" / "step-000004" / "trainable.safetensors"))
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
    steps = [line for line in (killed / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) == 4  # re-logged steps are not duplicated


def test_ctrl_c_finishes_the_step_saves_and_exits(tmp_path, tiny_sd3_dir, prompt_file):
    run_dir = tmp_path / "interrupted"
    proc = run_cli(["train", "/dev/null", *small_run(run_dir, tiny_sd3_dir, prompt_file, "trainer.max_steps=50",
                                                     "run.checkpoint_every=1000")])
    deadline = time.time() + 240
    metrics = run_dir / "metrics.jsonl"
    while not (metrics.exists() and metrics.read_text().strip()) and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 130, out
    saved = sorted((run_dir / "checkpoints").glob("step-*"))
    assert len(saved) == 1 and (saved[0] / "COMPLETE").exists()
    step = int(saved[0].name.split("-")[1])
    assert 1 <= step < 50
    assert len(metrics.read_text().splitlines()) == step  # the checkpoint holds every logged step
