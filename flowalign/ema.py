"""Exponential moving average of trainable weights (evaluated with ``swapped_in``)."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch


class EMA:
    """``shadow ← decay·shadow + (1−decay)·param`` every ``every`` optimiser steps (Flow-GRPO: 0.9 / 8)."""

    def __init__(self, params: list[torch.nn.Parameter], decay: float, every: int = 1):
        self.params, self.decay, self.every = list(params), decay, every
        self.shadow = [p.detach().clone() for p in self.params]
        self.num_updates = 0

    @torch.no_grad()
    def update(self) -> None:
        self.num_updates += 1
        if self.num_updates % self.every:
            return
        for s, p in zip(self.shadow, self.params):
            s.lerp_(p.detach(), 1 - self.decay)

    @contextmanager
    def swapped_in(self) -> Iterator[None]:
        """Temporarily load the averaged weights into the live parameters."""
        backup = [p.detach().clone() for p in self.params]
        with torch.no_grad():
            for p, s in zip(self.params, self.shadow):
                p.copy_(s)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, b in zip(self.params, backup):
                    p.copy_(b)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {f"shadow.{i}": s for i, s in enumerate(self.shadow)} | {
            "num_updates": torch.tensor(self.num_updates)
        }

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for i, s in enumerate(self.shadow):
            s.copy_(state[f"shadow.{i}"])
        self.num_updates = int(state["num_updates"])
