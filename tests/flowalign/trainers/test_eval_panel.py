"""``eval.rewards``: a held-out panel scored at every evaluation and logged as ``eval/<name>``; and a
training reward served by a server that is gone: its samples are invalid, the run goes on."""

from __future__ import annotations

import json
import socket

from flowalign.train import train
from tests.flowalign.trainers.conftest import small_config


def closed_port() -> int:
    """A local port nobody listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_panel_is_logged_and_a_dead_remote_reward_does_not_stop_the_run(tmp_path, tiny_sd3_dir, prompt_file, capsys):
    url = f"http://127.0.0.1:{closed_port()}"
    cfg = small_config(tmp_path / "run", tiny_sd3_dir, prompt_file,
                       f"rewards=[{{name: remote, url: '{url}', timeout: 2}}]", "run.max_invalid_fraction=1.0",
                       "trainer.max_steps=1", "trainer.prompts_per_step=1", "trainer.group_size=2",
                       "trainer.batch_size=2", "trainer.num_steps=2",
                       "eval.bench=vvr", "eval.level=easy", "eval.n=2", "eval.num_steps=2",
                       "eval.rewards=[brightness, {name: saturation, label: colourfulness}]")
    train(cfg)
    logs = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    step = next(r for r in logs if "reward/remote_invalid_fraction" in r)
    assert step["reward/remote_invalid_fraction"] == 1.0  # masked, and the run went on to its evaluations
    evals = [r for r in logs if "eval/brightness" in r]
    assert [r["step"] for r in evals] == [0, 1]
    assert all(0 <= r["eval/brightness"] <= 1 and "eval/colourfulness" in r and "eval/mean_score" in r for r in evals)
    rows = [json.loads(line) for line in (tmp_path / "run" / "evals" / "step-000001" / "results.jsonl").open()]
    assert set(rows[0]["scores"]) == {"brightness", "colourfulness"} and "constraints" in rows[0]
    page = (tmp_path / "run" / "gallery" / "index.html").read_text()
    assert 'data-metric="brightness"' in page and 'data-metric="colourfulness"' in page
    err = capsys.readouterr().err
    assert "Traceback" not in err and url in err
