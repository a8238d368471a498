"""Loss units shared by trainers."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GroupUnit:
    """Group ``index`` of the batch, weighted over the ``total`` groups of every rank."""

    index: int
    total: int
