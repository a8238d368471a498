"""Exponential moving average of trainable weights (evaluated with ``swapped_in``)."""

from __future__ import annotations

from contextlib import AbstractContextManager

import torch

from flowalign.weight_swap import swapped_in


class EMA:
    """``shadow ← decay·shadow + (1−decay)·param`` every ``every`` optimiser steps (Flow-GRPO: 0.9 / 8).

    ``warmup``: the decay of update ``n`` is ``min(decay, (1 + n) / (10 + n))``, so a model trained from
    scratch is not averaged with its random initialisation for the first ~1/(1−decay) steps.
    """

    def __init__(self, params: list[torch.nn.Parameter], decay: float, every: int = 1, warmup: bool = False):
        self.params, self.decay, self.every, self.warmup = list(params), decay, every, warmup
        self.shadow = [p.detach().clone() for p in self.params]
        self.num_updates = 0

    @torch.no_grad()
    def update(self) -> None:
        self.num_updates += 1
        if self.num_updates % self.every:
            return
        decay = self.decay
        if self.warmup:
            n = self.num_updates - 1
            decay = min(decay, (1 + n) / (10 + n))
        for s, p in zip(self.shadow, self.params):
            s.lerp_(p.detach(), 1 - decay)

    def swapped_in(self) -> AbstractContextManager[None]:
        """Temporarily load the averaged weights into the live parameters."""
        return swapped_in(self.params, self.shadow)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {f"shadow.{i}": s for i, s in enumerate(self.shadow)} | {
            "num_updates": torch.tensor(self.num_updates)
        }

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for i, s in enumerate(self.shadow):
            s.copy_(state[f"shadow.{i}"])
        self.num_updates = int(state["num_updates"])
