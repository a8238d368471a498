"""trainer.budget_clock: max_minutes counts wall seconds, or this process's CPU seconds."""

import json
import time

import pytest

from flowalign.train import build_trainer

from .conftest import small_config


def idle_while_collecting(trainer, seconds: float) -> None:
    """Sleep inside every rollout collection: wall time passes, this process spends no CPU on it
    (as when a run shares its cores with other work)."""
    collect = trainer.collect

    def slow_collect(step):
        time.sleep(seconds)
        return collect(step)

    trainer.collect = slow_collect


def logged_rows(trainer) -> list[dict]:
    return [json.loads(line) for line in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("clock", ["wall", "cpu"])
def test_the_budget_counts_the_chosen_clock(tmp_path, tiny_sd3_dir, prompt_file, clock):
    trainer = build_trainer(small_config(tmp_path / "run", tiny_sd3_dir, prompt_file, "trainer.max_steps=2",
                                         f"trainer.budget_clock={clock}"))
    idle_while_collecting(trainer, 0.5)
    trainer.train()
    rows = [r for r in logged_rows(trainer) if "time/step" in r]
    wall, cpu = sum(r["time/step"] for r in rows), sum(r["time/step_cpu"] for r in rows)
    assert len(rows) == 2 and wall > cpu + 0.9  # two sleeps of 0.5 s counted by the wall clock only
    assert trainer.train_seconds == pytest.approx(wall if clock == "wall" else cpu)
    assert rows[-1]["time/train_minutes"] == pytest.approx(trainer.train_seconds / 60)


def test_a_cpu_budget_resumes_with_the_cpu_seconds_spent(tmp_path, tiny_sd3_dir, prompt_file):
    args = (tmp_path / "run", tiny_sd3_dir, prompt_file, "trainer.max_steps=2", "trainer.budget_clock=cpu",
            "run.checkpoint_every=1")
    first = build_trainer(small_config(*args))
    first.train()
    again = build_trainer(small_config(*args, "run.resume=auto"))
    again.maybe_resume()
    assert again.step == 2
    assert again.train_seconds == pytest.approx(first.train_seconds)
    assert again.train_cpu_seconds == pytest.approx(first.train_cpu_seconds)
