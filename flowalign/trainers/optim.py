"""What the loop optimises and how: the trainable parameters, AdamW, the EMA, the LR schedule and one
optimiser step (gradients averaged over ranks, clipped, stepped, EMA updated).

:func:`setup_optimisation` is the one place where the model's trainable tensors meet the optimiser, so
a sharding or offloading scheme hooks in there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from flowalign.ema import EMA
from flowalign.errors import UserError
from flowalign.parallel import Parallel
from flowalign.protocols import FlowPolicy


@dataclass
class Optimisation:
    """The trainable tensors, their optimiser and (``ema_decay > 0``) their EMA."""

    params: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    ema: EMA | None
    #: how the weights are spread over ranks (replicated or FSDP2 shards)
    parallel: Parallel


def setup_optimisation(policy: FlowPolicy, tcfg: Any, parallel: Parallel) -> Optimisation:
    """AdamW over the policy's ``requires_grad`` parameters (``tcfg``: lr, betas, weight_decay,
    ema_decay, ema_every); under fsdp the transformer is sharded first, so they are this rank's shards."""
    parallel.shard(policy.trainable)
    params = [p for p in policy.trainable.parameters() if p.requires_grad]
    if not params:
        raise UserError("the policy has no trainable parameters; set model.finetune to lora or full")
    optimizer = torch.optim.AdamW(params, lr=tcfg.lr, betas=tcfg.betas, weight_decay=tcfg.weight_decay)
    ema = EMA(params, tcfg.ema_decay, tcfg.ema_every) if tcfg.ema_decay > 0 else None
    return Optimisation(params, optimizer, ema, parallel)


def scheduled_lr(tcfg: Any, step: int, fraction: float) -> float:
    """The LR at a budget fraction in [0, 1]: linear warm-up over ``lr_warmup_steps``, then constant or
    cosine down to ``lr_min_ratio·lr``."""
    lr = tcfg.lr
    if tcfg.lr_schedule == "cosine":
        lr *= tcfg.lr_min_ratio + (1 - tcfg.lr_min_ratio) * 0.5 * (1 + math.cos(math.pi * fraction))
    if step < tcfg.lr_warmup_steps:
        lr *= (step + 1) / tcfg.lr_warmup_steps
    return lr


def optimizer_step(opt: Optimisation, accelerator: Any, lr: float, grad_clip: float) -> float:
    """Average gradients over ranks, clip to ``grad_clip``, step at ``lr``, update the EMA; returns the
    pre-clip gradient norm."""
    if accelerator.num_processes > 1 and not opt.parallel.sharded:  # fsdp reduce-scatters during backward
        for p in opt.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            p.grad = accelerator.reduce(p.grad, reduction="mean")
    norm = opt.parallel.clip_grad_norm(opt.params, grad_clip)
    for group in opt.optimizer.param_groups:
        group["lr"] = lr
    opt.optimizer.step()
    opt.optimizer.zero_grad(set_to_none=True)
    if opt.ema is not None:
        opt.ema.update()
    return norm
