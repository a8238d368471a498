"""``eval.prompts``: a run evaluates on a held-out prompt file (PickScore's, HPSv3's) scored by the panel
``eval.rewards``, as it evaluates on a benchmark; a prompt file without a panel is one line before any step."""

from __future__ import annotations

import json

import pytest

from flowalign.errors import UserError
from flowalign.train import check_run, train
from tests.flowalign.trainers.conftest import prompt_file, small_config  # noqa: F401  (a fixture)


def test_a_run_evaluates_on_a_prompt_file_scored_by_its_panel(tmp_path, tiny_sd3_dir, prompt_file):
    held_out = tmp_path / "held_out.txt"
    held_out.write_text("a purple hexagon\na white cross\na black ring\n")
    cfg = small_config(tmp_path / "run", tiny_sd3_dir, prompt_file, "trainer.max_steps=1",
                       "trainer.prompts_per_step=1", "trainer.group_size=2", "trainer.batch_size=2",
                       "trainer.num_steps=2", f"eval.prompts={held_out}", "eval.n=2", "eval.num_steps=2",
                       "eval.rewards=[brightness, saturation]")
    train(cfg)
    logs = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in logs if "eval/brightness" in r]
    assert [r["step"] for r in evals] == [0, 1]
    assert all(0 <= r["eval/brightness"] <= 1 and "eval/saturation" in r for r in evals)
    folder = tmp_path / "run" / "evals" / "step-000001"
    rows = [json.loads(line) for line in (folder / "results.jsonl").open()]
    assert [r["prompt"] for r in rows] == ["a purple hexagon", "a white cross"]  # its first eval.n prompts
    assert set(rows[0]["scores"]) == {"brightness", "saturation"}
    metrics = json.loads((folder / "metrics.json").read_text())
    assert metrics["prompts"] == str(held_out) and metrics["rewards"] == ["brightness", "saturation"]


def test_a_prompt_file_without_a_panel_is_refused_before_the_run(tmp_path, tiny_sd3_dir, prompt_file):
    cfg = small_config(tmp_path / "run", tiny_sd3_dir, prompt_file, f"eval.prompts={prompt_file}")
    with pytest.raises(UserError, match="eval.prompts=.* has no verifier of its own: list the rewards .* in eval.rewards"):
        check_run(cfg)
    missing = small_config(tmp_path / "run", tiny_sd3_dir, prompt_file, f"eval.prompts={tmp_path / 'none.txt'}",
                           "eval.rewards=[brightness]")
    with pytest.raises(UserError, match="none.txt"):
        check_run(missing)
