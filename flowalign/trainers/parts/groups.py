"""Checks on how prompt groups fall into rollout batches."""

from __future__ import annotations

from typing import Any

from flowalign.errors import UserError


def check_whole_groups(tcfg: Any) -> None:
    """A pairwise judge compares the samples of one rollout batch: each batch must hold whole groups."""
    if tcfg.batch_size % tcfg.group_size:
        raise UserError(f"trainer.batch_size={tcfg.batch_size} must be a multiple of trainer.group_size="
                        f"{tcfg.group_size}: a pairwise judge compares the samples of one rollout batch, so "
                        f"each batch must hold whole groups (e.g. batch_size={tcfg.group_size})")
