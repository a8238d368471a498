"""Training only the best and the worst samples of each prompt group (DanceGRPO's video recipe)."""

from __future__ import annotations

import dataclasses
from typing import Any

from pydantic import Field

from flowalign.advantages import best_worst_mask
from flowalign.config import Section
from flowalign.errors import UserError
from flowalign.limits import MAX_GROUP_SIZE
from flowalign.trainers.rollouts import StepBatch


class BestWorstOptions(Section):
    """How many samples of each group are trained, chosen by advantage."""

    #: train only the best_of/2 best and best_of/2 worst samples of each group by advantage (0: all; the
    #: authors' HunyuanVideo script: 8 of 24)
    best_of: int = Field(0, ge=0, le=MAX_GROUP_SIZE)


def check_best_of(tcfg: Any) -> None:
    """Refuse an odd ``best_of`` (half of it are the best samples, half the worst)."""
    if tcfg.best_of % 2:
        raise UserError(f"trainer.best_of={tcfg.best_of} must be even (half best, half worst samples), e.g. 8")


def best_and_worst(batch: StepBatch, best_of: int) -> StepBatch:
    """A copy of ``batch`` whose advantages ``(N,)`` are zeroed (not trained) but for the ``best_of/2`` highest
    and ``best_of/2`` lowest of each group (computed over the whole group first); ``best_of_fraction`` logged.
    ``batch`` itself is unchanged."""
    keep = best_worst_mask(batch.advantages, batch.groups, best_of)
    return dataclasses.replace(batch, advantages=batch.advantages * keep,
                               logs={**batch.logs, "best_of_fraction": keep.float().mean().item()})
