"""The register authors' optimisation recipe (their ``training.py`` / ``configs/register/sd3/paper.yaml``), as
an optimizer any pair-fitting loop can step: AdamW (lr 5e-5, weight decay 0.01), a linear warm-up of the
learning rate over the first 1,000 steps, the gradient's global norm clipped to 1.0 before each step, and an
exponential moving average (decay 0.999, float32) of the trainable weights, which is what is saved as the
reward (:meth:`AuthorsRecipe.finish`)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

LR, WEIGHT_DECAY, WARMUP_STEPS, EMA_DECAY, MAX_GRAD_NORM = 5e-5, 0.01, 1000, 0.999, 1.0


class AuthorsRecipe:
    """``zero_grad()`` / ``step()`` / ``state_dict()`` like a torch optimizer over ``model``'s trainable
    parameters; ``step`` clips, steps AdamW, advances the warm-up and updates the average, in their order."""

    def __init__(self, model: nn.Module, *, lr: float = LR, weight_decay: float = WEIGHT_DECAY,
                 warmup_steps: int = WARMUP_STEPS, ema_decay: float = EMA_DECAY, max_grad_norm: float = MAX_GRAD_NORM):
        self.model = model
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=lr, weight_decay=weight_decay)
        # factor (step+1)/warmup on the lr, as their LambdaLR: the first step already uses 1/warmup of it
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: min(1.0, (step + 1) / warmup_steps) if warmup_steps > 0 else 1.0)
        self.ema_decay, self.max_grad_norm = float(ema_decay), float(max_grad_norm)
        self.ema = {n: p.detach().clone().float() for n, p in model.named_parameters() if p.requires_grad}

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm)
        self.optimizer.step()
        self.scheduler.step()
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                if name in self.ema:
                    self.ema[name].mul_(self.ema_decay).add_(p.detach().float(), alpha=1.0 - self.ema_decay)

    def finish(self) -> None:
        """Put the average into the model: the weights the reward is saved with."""
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                if name in self.ema:
                    p.copy_(self.ema[name].to(p.dtype))

    def state_dict(self) -> dict[str, Any]:
        return {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                "ema": {k: v.clone() for k, v in self.ema.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        for k, v in state["ema"].items():
            self.ema[k].copy_(v)

