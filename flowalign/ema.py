"""Exponential moving average of trainable weights (evaluated with ``swapped_in``)."""

from __future__ import annotations

from contextlib import AbstractContextManager

import torch

from flowalign.weight_swap import swapped_in


class EMA:
    """``shadow ← decay·shadow + (1−decay)·param`` every ``every`` optimiser steps (Flow-GRPO: 0.9 / 8).

    ``warmup``: the schedule of flow_grpo's ``EMAModuleWrapper`` as its scripts call it, with the count ``s``
    of optimiser steps taken: the decay is ``min(decay, (1 + s) / (10 + s))`` (a young model is not averaged
    with its starting weights for ~1/(1−decay) steps) and the average moves when ``(s + 1) % every == 0``.
    ``micro_batches``: flow_grpo's ``train_sd3.py`` calls the wrapper after every micro-batch and counts the
    step at its last one, so each step makes ``micro_batches − 1`` calls with the weights and count of the
    step before (:meth:`before_step`) and one after it (:meth:`update`).
    """

    def __init__(self, params: list[torch.nn.Parameter], decay: float, every: int = 1, warmup: bool = False,
                 micro_batches: int = 1):
        self.params, self.decay, self.every, self.warmup = list(params), decay, every, warmup
        self.micro_batches = micro_batches
        self.shadow = [p.detach().clone() for p in self.params]
        self.num_updates = 0

    @torch.no_grad()
    def _move(self, count: int) -> None:
        """One call of the average at ``count`` optimiser steps taken."""
        if self.warmup:
            if (count + 1) % self.every:
                return
            decay = min(self.decay, (1 + count) / (10 + count))
        else:
            if count % self.every:
                return
            decay = self.decay
        for s, p in zip(self.shadow, self.params):
            s.lerp_(p.detach(), 1 - decay)

    def before_step(self) -> None:
        """The calls a step's earlier micro-batches make, before the optimiser moves the weights."""
        for _ in range(self.micro_batches - 1):
            self._move(self.num_updates)

    def update(self) -> None:
        """After an optimiser step."""
        self.num_updates += 1
        self._move(self.num_updates)

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
