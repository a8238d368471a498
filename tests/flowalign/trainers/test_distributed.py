"""Two CPU processes under torchrun, stopped: a signal to one rank stops every rank at the same step with one
checkpoint. (Two ranks matching one process, trainer by trainer: test_two_ranks.py.)"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import REPO, small_run


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
