"""Every reward call has a deadline, and SIGTERM is never held up by a reward that hangs.

The hanging reward is a real plug-in: a module written to a folder on the path, which sleeps for an hour
when its control folder says so (and can send its own process SIGTERM first, as a scheduler would)."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from flowalign import checkpoint as ckpt
from flowalign.cli.main import main
from flowalign.config import REWARD_TIMEOUT_S, load_config
from flowalign.errors import UserError
from flowalign.reward_set import RewardSet, TimeLimited
from flowalign.run_lock import LOCK_NAME
from flowalign.signals import Abandoned, Terminated, abandonable, clear_stop, request_stop
from flowalign.train import FINAL_METRICS, build_trainer, train
from tests.flowalign.trainers.conftest import REPO, prompt_file, small_run  # noqa: F401 (a fixture)

PLUGIN = '''
import os, signal, time
from pathlib import Path

CONTROL = Path({control!r})


def reward(samples, prompts, metadata):
    """Redness; from call number CONTROL/hang on, it writes CONTROL/hanging and sleeps for an hour."""
    calls = CONTROL / "calls"
    n = int(calls.read_text()) if calls.exists() else 0
    calls.write_text(str(n + 1))
    hang = CONTROL / "hang"
    if hang.exists() and n >= int(hang.read_text()):
        (CONTROL / "hanging").touch()
        if (CONTROL / "sigterm").exists():
            os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(3600)
    return samples[:, 0].flatten(1).mean(1) - samples[:, 1:].flatten(1).mean(1)
'''

_names = itertools.count()


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    """``(reward name, control folder)`` of a fresh hanging plug-in module importable from ``tmp_path``."""
    control = tmp_path / "control"
    control.mkdir()
    module = f"hanging_reward_{os.getpid()}_{next(_names)}"
    (tmp_path / f"{module}.py").write_text(PLUGIN.format(control=str(control)))
    monkeypatch.syspath_prepend(str(tmp_path))
    return f"{module}:reward", control


def _hang_from(control: Path, call: int, sigterm: bool = False) -> None:
    (control / "hang").write_text(str(call))
    if sigterm:
        (control / "sigterm").touch()


def test_every_reward_gets_the_default_deadline(tmp_path, tiny_sd3_dir, prompt_file, plugin):
    name, _ = plugin
    cfg = load_config(None, small_run(tmp_path / "run", tiny_sd3_dir, prompt_file, f"rewards=[{{name: '{name}'}}]"))
    assert cfg.rewards[0].timeout_s == REWARD_TIMEOUT_S
    reward = build_trainer(cfg).rewards.entries[0][2]
    assert isinstance(reward, TimeLimited) and reward._timeout_s == REWARD_TIMEOUT_S


def test_a_sleeping_plugin_is_masked_within_its_deadline_and_the_run_stops_in_one_line(
        tmp_path, tiny_sd3_dir, prompt_file, plugin, capsys):
    name, control = plugin
    _hang_from(control, 0)
    t = build_trainer(load_config(None, small_run(tmp_path / "run", tiny_sd3_dir, prompt_file,
                                                  f"rewards=[{{name: '{name}', timeout_s: 1}}]")))
    start = time.monotonic()
    with pytest.raises(UserError) as e:
        t.train_step()
    assert time.monotonic() - start < 60  # the deadline, not the plug-in's hour
    message = str(e.value)
    assert "100% of the samples have invalid rewards" in message and "run.max_invalid_fraction" in message
    assert f"{name}: gave no answer within timeout_s=1 s" in message and len(message.splitlines()) == 1
    assert f"warning: reward '{name}' gave no answer within timeout_s=1 s" in capsys.readouterr().out


def test_a_reward_wait_gives_up_on_sigterm_inside_abandonable_work_only(plugin):
    from rewards.registry import load

    name, control = plugin
    _hang_from(control, 0)
    rewards = RewardSet([("hangs", 1.0, TimeLimited("hangs", load(name), 60))])
    x = torch.rand(2, 3, 8, 8)
    try:
        request_stop()
        with abandonable(), pytest.raises(Abandoned, match="'hangs'"):
            rewards.score(x, ["a", "b"], [{}, {}])  # SIGTERM is not the reward's failure: it goes on up
        with abandonable(allowed=False):  # several ranks: the wait keeps its deadline
            slow = TimeLimited("hangs", load(name), 0.3)
            scored = RewardSet([("hangs", 1.0, slow)]).score(x, ["a", "b"], [{}, {}])
        assert not scored.valid.any() and "gave no answer" in scored.reasons[0]
    finally:
        clear_stop()


def _train_process(args: list[str], path: Path) -> subprocess.Popen:
    """``python -m flowalign ARGS`` with ``path`` importable (where the plug-in lives)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{REPO}{os.pathsep}{path}", "HF_HUB_OFFLINE": "1"}
    return subprocess.Popen([sys.executable, "-m", "flowalign", *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_sigterm_while_a_reward_hangs_saves_the_last_step_and_exits_143_within_seconds(
        tmp_path, tiny_sd3_dir, prompt_file, plugin, capsys):
    name, control = plugin
    _hang_from(control, 2)  # step 1 (two batches) scores; step 2's first batch hangs
    run_dir = tmp_path / "run"
    args = ["train", "/dev/null", *small_run(run_dir, tiny_sd3_dir, prompt_file, f"rewards=[{{name: '{name}'}}]",
                                             "run.checkpoint_every=1000")]
    proc = _train_process(args, tmp_path)
    try:
        deadline = time.monotonic() + 300
        while not (control / "hanging").exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (control / "hanging").exists(), proc.communicate(timeout=60)[0]
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        # the lock goes once the checkpoint is saved (the interpreter's own teardown comes after)
        while (run_dir / LOCK_NAME).exists() and proc.poll() is None and time.monotonic() < sent + 120:
            time.sleep(0.05)
        took = time.monotonic() - sent
        out = proc.communicate(timeout=120)[0]
    finally:
        proc.kill()
    assert proc.returncode == 143, out
    assert took < 20, f"{took:.1f} s"  # seconds, not the reward's 600 s deadline
    saved = run_dir / "checkpoints" / "step-000001"
    assert f"terminated: SIGTERM received; saved {saved} at step 1" in out and f"reward '{name}'" in out
    assert ckpt.latest_checkpoint(run_dir) == saved and "Traceback" not in out
    assert not (run_dir / LOCK_NAME).exists() and not [p for p in run_dir.rglob("*") if ".tmp-" in p.name]
    # the outage over, the same command resumes from the saved step and finishes
    (control / "hang").unlink()
    assert main(args) == 0
    assert f"resumed from {saved} at step 1" in capsys.readouterr().out
    assert json.loads((ckpt.latest_checkpoint(run_dir) / "trainer_state.json").read_text())["step"] == 2


def test_a_final_evaluation_cut_by_sigterm_is_not_recorded_and_the_rerun_scores_it(
        tmp_path, tiny_sd3_dir, prompt_file, plugin, capsys):
    name, control = plugin
    _hang_from(control, 0, sigterm=True)  # the panel's first call is the final evaluation's
    run_dir = tmp_path / "run"
    overrides = small_run(run_dir, tiny_sd3_dir, prompt_file, "trainer.max_steps=1", f"eval.prompts={prompt_file}",
                          f"eval.rewards=[{{name: '{name}'}}]", "eval.n=2", "eval.batch_size=2", "eval.at_start=false",
                          "eval.num_steps=2", "eval.gallery=false")
    cfg = load_config(None, overrides)
    with pytest.raises(Terminated):
        train(cfg)
    assert not (run_dir / FINAL_METRICS).exists()  # not finished: no null panel recorded as the result
    assert ckpt.latest_checkpoint(run_dir) == run_dir / "checkpoints" / "step-000001"
    assert not (run_dir / LOCK_NAME).exists()
    (control / "hang").unlink()
    final = train(cfg)
    assert "already finished" not in capsys.readouterr().out
    assert final[f"{name}/valid_fraction"] == 1.0 and json.loads((run_dir / FINAL_METRICS).read_text()) == final


def test_a_step_dropped_on_sigterm_resumes_to_the_uninterrupted_weights(tmp_path, tiny_sd3_dir, prompt_file, plugin):
    from safetensors.torch import load_file

    name, control = plugin
    runs = {}
    for label in ("interrupted", "straight"):
        cfg = load_config(None, small_run(tmp_path / label, tiny_sd3_dir, prompt_file, f"rewards=[{{name: '{name}'}}]",
                                          "run.checkpoint_every=1000"))
        if label == "interrupted":
            _hang_from(control, 2, sigterm=True)  # step 2's first batch: SIGTERM, then an hour's sleep
            torch.manual_seed(0)
            with pytest.raises(Terminated, match="saved .*step-000001 at step 1"):
                train(cfg)
            (control / "hang").unlink()
        torch.manual_seed(0)
        train(cfg)
        runs[label] = load_file(str(ckpt.latest_checkpoint(tmp_path / label) / "trainable.safetensors"))
    assert runs["interrupted"].keys() == runs["straight"].keys()
    for key, value in runs["straight"].items():
        assert torch.equal(runs["interrupted"][key], value), key


def test_a_gradient_reward_past_its_deadline_adds_nothing_with_a_warning(plugin, capsys):
    from rewards.registry import load

    name, control = plugin
    _hang_from(control, 0)
    x = torch.rand(2, 3, 8, 8, requires_grad=True)
    rewards = RewardSet([("hangs", 1.0, TimeLimited("hangs", load(name), 0.2)),
                         ("mean", 2.0, TimeLimited("mean", load("tests.flowalign.trainers.toy_rewards:redness"), 60))])
    total = rewards.weighted_total(x, ["a", "b"], [{}, {}])
    expected = 2 * (x[:, 0].flatten(1).mean(1) - x[:, 1:].flatten(1).mean(1))
    torch.testing.assert_close(total, expected)
    total.sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
    assert "warning: reward 'hangs' gave no answer within timeout_s=0.2 s" in capsys.readouterr().out
