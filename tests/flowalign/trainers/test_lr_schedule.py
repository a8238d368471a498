"""The shared loop's learning-rate schedule (trainer.lr_schedule, lr_warmup_steps, lr_min_ratio)."""

import json
import math

import pytest

from flowalign.train import build_trainer

from .conftest import small_config


@pytest.fixture
def cosine(tmp_path, tiny_sd3_dir, prompt_file):
    return build_trainer(small_config(tmp_path / "run", tiny_sd3_dir, prompt_file, "trainer.lr_schedule=cosine",
                                      "trainer.lr_warmup_steps=2", "trainer.lr_min_ratio=0.2", "trainer.max_steps=4"))


def test_cosine_schedule_with_warmup(cosine):
    lr, schedule = cosine.tcfg.lr, cosine.optimisation.schedule
    assert schedule.at(0, 0.0) == pytest.approx(lr * 0.5)  # warm-up step 1 of 2
    assert schedule.at(2, 0.0) == pytest.approx(lr)
    assert schedule.at(2, 0.5) == pytest.approx(lr * (0.2 + 0.8 * 0.5))
    assert schedule.at(2, 1.0) == pytest.approx(lr * 0.2)
    values = [schedule.at(2, f / 10) for f in range(11)]
    assert all(a > b for a, b in zip(values, values[1:]))


def test_beginning_a_step_sets_the_lr_in_the_optimiser_at_the_trainers_step(cosine):
    cosine.step = 1  # the step counter lives with the schedule: the trainer's step is the optimisation's
    assert cosine.optimisation.step == 1
    lr = cosine.optimisation.begin_step(0.0)
    assert lr == pytest.approx(cosine.tcfg.lr) == cosine.optimisation.schedule.lr  # warm-up step 2 of 2
    assert {g["lr"] for g in cosine.optimizer.param_groups} == {lr}


def test_budget_fraction_takes_the_larger_of_steps_and_minutes(cosine):
    cosine.step, cosine.train_seconds = 1, 0.0
    assert cosine.budget_fraction() == pytest.approx(0.25)
    cosine.tcfg.max_minutes = 1.0
    cosine.train_seconds = 30.0
    assert cosine.budget_fraction() == pytest.approx(0.5)
    cosine.train_seconds = 600.0
    assert cosine.budget_fraction() == 1.0


def test_the_optimiser_uses_and_logs_the_scheduled_lr(cosine):
    cosine.train()
    rows = [json.loads(line) for line in (cosine.run_dir / "metrics.jsonl").read_text().splitlines()]
    logged = [r["train/lr"] for r in rows if "train/lr" in r]
    lr = cosine.tcfg.lr
    expected = [lr * 0.5, lr * (0.2 + 0.8 * 0.5 * (1 + math.cos(math.pi / 4))), lr * 0.6,
                lr * (0.2 + 0.8 * 0.5 * (1 + math.cos(3 * math.pi / 4)))]
    assert logged == pytest.approx(expected)
    assert cosine.optimizer.param_groups[0]["lr"] == pytest.approx(expected[-1])


def test_a_cosine_over_fewer_steps_than_the_budget_holds_its_floor_after(tmp_path, tiny_sd3_dir, prompt_file):
    """FestDPO's text-to-image schedule: the cosine over the first ``lr_decay_steps``, then the floor held."""
    trainer = build_trainer(small_config(tmp_path / "run", tiny_sd3_dir, prompt_file, "trainer.lr_schedule=cosine",
                                         "trainer.lr_min_ratio=0.25", "trainer.lr_decay_steps=2",
                                         "trainer.max_steps=4"))
    trainer.train()
    rows = [json.loads(line) for line in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
    lr = trainer.tcfg.lr
    # steps 0 and 1 follow the cosine over 2 steps, steps 2 and 3 stay at 0.25·lr (the budget's cosine: 0.4·lr)
    assert [r["train/lr"] for r in rows if "train/lr" in r] == pytest.approx([lr, lr * 0.625, lr * 0.25, lr * 0.25])


def test_decay_steps_without_the_cosine_are_refused_by_name(tmp_path, tiny_sd3_dir, prompt_file):
    with pytest.raises(Exception, match="trainer.lr_decay_steps.*lr_schedule: cosine"):
        build_trainer(small_config(tmp_path / "run", tiny_sd3_dir, prompt_file, "trainer.lr_decay_steps=300"))


def test_the_warmup_from_a_start_factor_is_the_crosstimeedit_sft_runners():
    """CrossTimeEdit's SFT runner warms up with torch's LinearLR, stepped by accelerate once per process on every
    optimiser step (4 GPUs): their 412 (first run) and 300 (second run) scheduler steps are 103 and 75
    optimiser steps, from 1e-3·lr and 0.6·lr; the second run's cosine decay is placed past its end (its total
    counts dataset items before accelerate shards them), so both are constant after the warm-up
    (``known_answers/crosstimeedit_sft_lr.json``, their runner's lines under accelerate)."""
    import json
    from pathlib import Path

    from flowalign.trainers.optim import Schedule

    known = json.loads((Path(__file__).parent / "known_answers" / "crosstimeedit_sft_lr.json").read_text())
    for run, start in (("phase1", 1e-3), ("phase2", 0.6)):
        theirs = known[run]["lr_per_optimiser_step"]
        schedule = Schedule(known[run]["lr"], "constant", known[run]["warmup_steps"] // 4, warmup_start=start)
        ours = [schedule.at(step, step / len(theirs)) for step in range(len(theirs))]
        assert ours == pytest.approx(theirs, rel=1e-9)
    # without the start factor, the former form: (step + 1)/warmup_steps
    assert Schedule(1.0, "constant", 4).at(0, 0.0) == 0.25 and Schedule(1.0, "constant", 4, warmup_start=0.5).at(0, 0.0) == 0.5


def test_a_warmup_start_without_warmup_steps_is_refused_by_name():
    from flowalign.trainers import trainer_config

    with pytest.raises(Exception, match="trainer.lr_warmup_start.*lr_warmup_steps is 0"):
        trainer_config({"name": "flow_grpo", "lr_warmup_start": 0.5})
