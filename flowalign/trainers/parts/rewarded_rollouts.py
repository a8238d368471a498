"""The loop's group rollouts of a step with their rewards, and no advantages: for a trainer that learns
from the rewards themselves (a preference pair's winner, a refit's labels), so it reads no advantage
option."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch

from flowalign.trainers.rollouts import StepBatch


def rewarded_rollouts(trainer: Any, step: int) -> StepBatch:
    """The step's prompts rolled out as the loop's default ``collect`` rolls them out (the same noise and
    batches), scored through the trainer's scoring service (the invalid guard, the reward logs) without
    advantages: ``advantages`` is None. A collective."""
    prompts, metadata, groups = trainer.step_prompts(step)
    prompt_ids = torch.tensor(trainer.step_indices(step)).repeat_interleave(trainer.tcfg.group_size)
    batch = trainer.sample(prompts, metadata, groups, prompt_ids, step)
    t = time.perf_counter()
    scored = trainer.judge(batch.scores, batch.samples, None, step)
    logs = {**batch.logs, **scored.logs}
    logs["time/reward"] = logs.get("time/reward", 0.0) + time.perf_counter() - t
    return dataclasses.replace(batch, logs=logs)
