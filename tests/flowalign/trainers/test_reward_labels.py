"""Two entries of one reward in a run's ``rewards:`` (e.g. UnifiedReward-Edit's two pointwise judgements) go by
their labels: each scores, logs and takes its advantage under its own name; without labels they are refused."""

from __future__ import annotations

import pytest

from flowalign.errors import UserError
from flowalign.train import build_trainer, check_run
from tests.flowalign.trainers.conftest import small_config


def test_two_entries_of_one_reward_go_by_their_labels(tmp_path, tiny_sd3_dir, prompt_file):
    twice = "rewards=[{name: brightness, weight: 1.0}, {name: brightness, weight: 0.5}]"
    with pytest.raises(UserError, match=r"rewards: reward 'brightness' is given twice; give the second a label"):
        check_run(small_config(tmp_path / "a", tiny_sd3_dir, prompt_file, twice))
    labelled = ("rewards=[{name: brightness, weight: 1.0, label: bright}, "
                "{name: saturation, weight: 0.5}, {name: brightness, weight: 0.5, label: bright_half}]")
    trainer = build_trainer(small_config(tmp_path / "b", tiny_sd3_dir, prompt_file, labelled))
    assert trainer.rewards.names == ["bright", "saturation", "bright_half"]
    batch = trainer.collect(0)
    scores = batch.scores
    assert scores.names == ["bright", "saturation", "bright_half"]
    assert (scores.values[:, 0] == scores.values[:, 2]).all()  # one reward, twice
    assert {"reward/bright", "reward/bright_half"} <= set(scores.logs())
