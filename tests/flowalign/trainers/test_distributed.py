"""Two CPU processes under torchrun: ranks end with identical weights, and the gathered group statistics
(and so the update) match a single process holding all the groups, batched differently: samples do not
depend on the rank layout or the batching."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from .conftest import REPO, run_cli, small_run


@pytest.mark.skipif(shutil.which("torchrun", path=str(Path(sys.executable).parent)) is None, reason="torchrun missing")
def test_two_ranks_match_one_process(tmp_path, tiny_sd3_dir, prompt_file):
    ddp_dir, single_dir = tmp_path / "ddp", tmp_path / "single"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_CBWR": "COMPATIBLE", "PYTHONPATH": str(REPO),
           "HF_HUB_OFFLINE": "1"}
    torchrun = str(Path(sys.executable).parent / "torchrun")
    ddp = subprocess.run(
        [torchrun, "--standalone", "--nproc_per_node", "2", "-m", "flowalign", "train", "/dev/null",
         *small_run(ddp_dir, tiny_sd3_dir, prompt_file, "trainer.prompts_per_step=1")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )
    assert ddp.returncode == 0, ddp.stdout[-3000:] + ddp.stderr[-3000:]
    # one process holding both groups in one rollout batch of 8 (the ranks roll out one group of 4 each)
    single = run_cli(["train", "/dev/null", *small_run(single_dir, tiny_sd3_dir, prompt_file, "trainer.prompts_per_step=2",
                                                       "trainer.batch_size=8")])
    out, _ = single.communicate(timeout=300)
    assert single.returncode == 0, out

    state = json.loads((ddp_dir / "checkpoints" / "step-000002" / "trainer_state.json").read_text())
    assert state["world_size"] == 2 and len(set(state["rank_checksums"])) == 1  # identical weights on both ranks

    rows = lambda d: [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
    for a, b in zip(rows(ddp_dir), rows(single_dir)):  # same groups, same noise, gathered statistics
        assert a["reward/total"] == pytest.approx(b["reward/total"], abs=1e-6)
        assert a["zero_adv_fraction"] == b["zero_adv_fraction"]
    wa = load_file(str(ddp_dir / "checkpoints" / "step-000002" / "trainable.safetensors"))
    wb = load_file(str(single_dir / "checkpoints" / "step-000002" / "trainable.safetensors"))
    assert max((wa[k] - wb[k]).abs().max().item() for k in wa) < 1e-5
    assert max(wa[k].abs().max().item() for k in wa if "lora_B" in k) > 0  # B starts at zero: the weights moved


def _rank_pid(parent: int, rank: int) -> int | None:
    """The pid of torchrun's worker ``rank`` (a child of ``parent`` whose environment holds RANK=rank)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            env = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == parent and f"RANK={rank}".encode() in env:
            return int(entry.name)
    return None


@pytest.mark.skipif(shutil.which("torchrun", path=str(Path(sys.executable).parent)) is None or not Path("/proc").is_dir(),
                    reason="torchrun or /proc missing")
def test_sigterm_to_one_rank_stops_every_rank_at_the_same_step_with_one_checkpoint(tmp_path, tiny_sd3_dir, prompt_file):
    """A scheduler's SIGTERM reaches ranks at different moments: the ranks agree on the step to stop after
    (saving is a collective), so one consistent checkpoint is written and no rank hangs."""
    import signal
    import time

    run_dir = tmp_path / "ddp"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    torchrun = str(Path(sys.executable).parent / "torchrun")
    proc = subprocess.Popen(
        [torchrun, "--standalone", "--nproc_per_node", "2", "-m", "flowalign", "train", "/dev/null",
         *small_run(run_dir, tiny_sd3_dir, prompt_file, "trainer.prompts_per_step=1", "trainer.max_steps=200",
                    "run.checkpoint_every=1000")],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 240
        while not ((run_dir / "metrics.jsonl").exists() and (run_dir / "metrics.jsonl").read_text().strip()):
            assert proc.poll() is None and time.time() < deadline, proc.stdout.read() if proc.poll() is not None else "no step"
            time.sleep(0.5)
        rank0 = _rank_pid(proc.pid, 0)
        assert rank0 is not None
        os.kill(rank0, signal.SIGTERM)  # rank 1 never receives one
        out = proc.communicate(timeout=180)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "SIGTERM received; saved" in out, out[-3000:]
    saved = sorted((run_dir / "checkpoints").glob("step-*"))
    assert len(saved) == 1, out[-3000:]
    state = json.loads((saved[0] / "trainer_state.json").read_text())
    assert state["world_size"] == 2 and len(set(state["rank_checksums"])) == 1
    assert state["step"] < 200
