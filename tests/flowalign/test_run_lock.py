"""One live ``train`` per run folder: a second one refuses in one line; a dead owner's lock is taken over."""

import json
import os
import signal
import socket
import subprocess
import time

import pytest

from flowalign.cli.main import main
from flowalign.errors import UserError
from flowalign.run_lock import LOCK_NAME, acquire, release
from tests.flowalign.trainers.conftest import prompt_file, run_cli, small_run  # noqa: F401 (a fixture)


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def _lock(folder, **owner):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / LOCK_NAME).write_text(json.dumps({"host": socket.gethostname(), "since": "then", **owner}))


def test_a_dead_or_reused_pid_is_stale_and_taken_over(tmp_path, capsys):
    _lock(tmp_path / "a", pid=_dead_pid())
    lock = acquire(tmp_path / "a")
    assert json.loads(lock.read_text())["pid"] == os.getpid()
    assert "stale lock" in capsys.readouterr().err
    release(lock)
    assert not (tmp_path / "a").exists()  # nothing else was written: the folder goes too
    _lock(tmp_path / "b", pid=os.getppid(), start="0")  # a live pid that started at another time: reused
    release(acquire(tmp_path / "b"))
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / LOCK_NAME).write_text('{"pid": 12')  # torn by a kill mid-write
    release(acquire(tmp_path / "c"))


def test_a_live_owner_or_another_host_refuses(tmp_path):
    _lock(tmp_path / "a", pid=os.getppid())
    with pytest.raises(UserError, match="in use by another flowalign train") as err:
        acquire(tmp_path / "a")
    assert str(os.getppid()) in str(err.value) and len(str(err.value).splitlines()) == 1
    _lock(tmp_path / "b", pid=1, host="elsewhere")
    with pytest.raises(UserError, match="delete .*train.lock"):
        acquire(tmp_path / "b")


def test_a_second_live_train_on_the_folder_refuses(tmp_path, capsys, tiny_sd3_dir, prompt_file):
    run_dir = tmp_path / "r"
    args = ["train", "/dev/null", *small_run(run_dir, tiny_sd3_dir, prompt_file, "trainer.max_steps=200",
                                              "run.checkpoint_every=1000")]
    first = run_cli(args)
    try:
        deadline = time.time() + 120
        while not (run_dir / "metrics.jsonl").exists() and first.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        assert first.poll() is None, first.communicate()[0]
        assert main(args) == 2
        err = capsys.readouterr().err
        assert "in use by another flowalign train" in err and f"pid {first.pid}" in err
        assert len(err.strip().splitlines()) == 1
        rows = (run_dir / "metrics.jsonl").read_text().splitlines()
        assert [json.loads(r)["step"] for r in rows] == list(range(1, len(rows) + 1))  # not interleaved
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    assert (run_dir / LOCK_NAME).exists()  # left by the kill: stale now
    assert main(["train", "/dev/null", *small_run(run_dir, tiny_sd3_dir, prompt_file, "trainer.max_steps=1")]) == 0
    assert "stale lock" in capsys.readouterr().err and not (run_dir / LOCK_NAME).exists()
    # killed before its first checkpoint: the rerun started over and logged each step once
    assert [json.loads(r)["step"] for r in (run_dir / "metrics.jsonl").read_text().splitlines()] == [1]


def _race(run_dir, start, held, results):
    """One contender: try the lock when all are ready, report, and hold it until every one has tried."""
    import contextlib
    import io

    start.wait()
    with contextlib.redirect_stderr(io.StringIO()):
        try:
            lock = acquire(run_dir)
        except UserError:
            lock = None
    results.put(lock is not None)
    held.wait()
    if lock is not None:
        release(lock)


def test_racing_takeovers_of_a_stale_lock_give_one_owner(tmp_path):
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    contenders, trials = 4, 20
    owners = []
    for trial in range(trials):
        run_dir = tmp_path / f"r{trial}"
        _lock(run_dir, pid=_dead_pid())
        start, held, results = ctx.Barrier(contenders), ctx.Barrier(contenders), ctx.Queue()
        procs = [ctx.Process(target=_race, args=(run_dir, start, held, results)) for _ in range(contenders)]
        for p in procs:
            p.start()
        owners.append(sum(results.get(timeout=60) for _ in procs))
        for p in procs:
            p.join(timeout=60)
            assert p.exitcode == 0
    assert owners == [1] * trials


def test_sigterm_saves_the_step_releases_the_lock_and_exits_143(tmp_path, tiny_sd3_dir, prompt_file):
    from flowalign import checkpoint as ckpt

    run_dir = tmp_path / "r"
    args = ["train", "/dev/null", *small_run(run_dir, tiny_sd3_dir, prompt_file, "trainer.max_steps=200",
                                              "run.checkpoint_every=1000")]
    proc = run_cli(args)
    deadline = time.time() + 120
    while not (run_dir / "metrics.jsonl").exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 143, out
    saved = ckpt.latest_checkpoint(run_dir)
    assert saved is not None and f"terminated: SIGTERM received; saved {saved}" in out
    assert not (run_dir / LOCK_NAME).exists() and not [p for p in run_dir.rglob("*") if ".tmp-" in p.name]
    step = json.loads((saved / "trainer_state.json").read_text())["step"]
    assert [json.loads(r)["step"] for r in (run_dir / "metrics.jsonl").read_text().splitlines()] == \
        list(range(1, step + 1))
    # what a SIGKILL strands is swept by the next start (the lock says every writer there was this run's)
    stale = [run_dir / "evals" / ".step-000001.tmp-abc", run_dir / "checkpoints" / ".tmp-step-000009",
             run_dir / f".config.yaml.tmp-{_dead_pid()}-x"]
    for folder in stale:
        folder.mkdir(parents=True)
    assert main([*args[:-2], f"trainer.max_steps={step + 1}", "run.checkpoint_every=1000"]) == 0
    assert not [p for p in stale if p.exists()]
