"""metrics.jsonl across resumes: rows after the checkpoint are dropped, rows of the resumed step logged once."""

import json

from flowalign.logger import RunLogger


def _logger(folder):
    return RunLogger(folder, enabled=True, tensorboard=False, wandb=False, project="p", name="n", config={})


def test_rows_of_the_resumed_step_are_not_logged_twice(tmp_path):
    rows = [{"step": 1, "train/loss": 1.0}, {"step": 2, "train/loss": 0.5}, {"step": 2, "eval/accuracy": 0.25},
            {"step": 3, "train/loss": 0.1}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    logger = _logger(tmp_path)
    logger.truncate_after(2)  # resumed at step 2, whose final evaluation was logged before the kill
    logger.log(2, {"eval/accuracy": 0.25})
    logger.log(3, {"train/loss": 0.2})
    logger.log(3, {"eval/accuracy": 0.5})
    logged = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert logged == [*rows[:3], {"step": 3, "train/loss": 0.2}, {"step": 3, "eval/accuracy": 0.5}]


def test_a_run_without_checkpoint_starts_its_rows_over(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "eval/n": 1}\n{"step": 1, "train/loss": 1.0}\n')
    logger = _logger(tmp_path)
    logger.truncate_after(-1)
    logger.log(0, {"eval/n": 1})
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 0, "eval/n": 1}\n'
