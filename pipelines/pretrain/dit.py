"""The transformer stage of a tiny world: rectified flow on cached latents, text encoders trained jointly.

``x_σ = (1 − σ)·x0 + σ·ε``, target ``v = ε − x0``, ``timestep = 1000σ``, σ logit-normal(0, 1) as in SD3;
a fraction ``--drop`` of prompts is replaced by "" for classifier-free guidance. Text embeddings come from
the pipeline's own ``encode_prompt`` (with gradients), so training sees exactly what inference feeds the
transformer. AdamW (no decay on norms, embeddings and biases), EMA with warm-up (:class:`flowalign.ema.EMA`),
constant LR then a cosine to 10 % over the last 30 % of the budget.
"""

from __future__ import annotations

import argparse
import math
import random
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from flowalign.ema import EMA
from pipelines.pretrain.data import level_sampling_weights
from pipelines.pretrain.stage import LRSchedule, Stage, run_stage

#: ``prompts → the transformer's text keyword arguments`` (with gradients)
Conditioning = Callable[[list[str]], dict[str, torch.Tensor]]
#: ``(transformer, items' clean latents, text kwargs) → loss`` (an editing family's items are pairs)
FlowLoss = Callable[[torch.nn.Module, torch.Tensor, dict[str, torch.Tensor]], torch.Tensor]


def named_trainable(pipe, trained: tuple[str, ...]) -> list[tuple[str, torch.nn.Parameter]]:
    """``(component.name, parameter)`` of the trained components, tied weights once."""
    out, seen = [], set()
    for component in trained:
        for name, p in getattr(pipe, component).named_parameters():
            if id(p) not in seen:  # UMT5's shared / embed_tokens train once
                seen.add(id(p))
                out.append((f"{component}.{name}", p))
    return out


def dit_optimizer(named: list[tuple[str, torch.nn.Parameter]], lr: float, wd: float) -> torch.optim.AdamW:
    decay, no_decay = [], []
    for n, p in named:
        (no_decay if p.ndim < 2 or "norm" in n or "embed" in n or "shared" in n else decay).append(p)
    return torch.optim.AdamW([{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.99))


def dit_lr(base: float, warmup: int) -> LRSchedule:
    """Linear warm-up (again after a continuation), constant, cosine to 10 % over the last 30 %."""

    def lr(step: int, restart: int, fraction: float) -> float:
        warm = min(1.0, (step - restart + 1) / warmup)
        cool = 1.0 if fraction < 0.7 else 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (fraction - 0.7) / 0.3))
        return base * warm * cool

    return lr


def flow_matching_loss(transformer: torch.nn.Module, x: torch.Tensor, cond: dict[str, torch.Tensor]) -> torch.Tensor:
    """Rectified-flow loss of clean latents ``x (B, C, H, W)`` or ``(B, C, F, H, W)``."""
    sigma = torch.sigmoid(torch.randn(len(x)))  # logit-normal(0, 1), as SD3
    eps = torch.randn(x.shape)  # not randn_like: its values would depend on x's memory layout
    s = sigma.view(-1, *[1] * (x.ndim - 1))
    v = transformer(hidden_states=(1 - s) * x + s * eps, timestep=1000 * sigma, **cond, return_dict=False)[0]
    return F.mse_loss(v.float(), (eps - x).float())


def train_dit(pipe, data: dict, x0: torch.Tensor, args: argparse.Namespace, out: Path, trained: tuple[str, ...],
              conditioning: Conditioning, flow_loss: FlowLoss = flow_matching_loss) -> EMA:
    """Stage ``dit`` on cached latents ``x0 (N, ...)`` of ``data``'s prompts; returns the EMA of the
    trained weights (what the export writes). ``flow_loss``: a family that feeds its transformer
    otherwise (an editing family's items are pairs) gives its own."""
    named = named_trainable(pipe, trained)
    params = [p for _, p in named]
    for p in params:
        p.requires_grad_(True)
    ema = EMA(params, args.ema, warmup=True)
    stage = Stage(out / "dit", {name: getattr(pipe, name) for name in trained}, params,
                  dit_optimizer(named, args.lr, args.wd), args.dit_steps, args.dit_minutes,
                  seed=args.seed, save_every=args.save_every, ema=ema)
    prompts = data["prompts"]
    weights = level_sampling_weights(data["levels"], args.dit_level_weights)

    def loss(fraction: float) -> tuple[torch.Tensor, dict[str, float]]:
        idx = (torch.randint(0, len(prompts), (args.batch,)) if weights is None
               else torch.multinomial(weights, args.batch, True))
        batch_prompts = [prompts[i] if random.random() >= args.drop else "" for i in idx.tolist()]
        return flow_loss(pipe.transformer, x0[idx], conditioning(batch_prompts)), {}

    for name in trained:
        getattr(pipe, name).train()
    run_stage(stage, loss, dit_lr(args.lr, args.warmup), resume=args.resume)
    for name in trained:
        getattr(pipe, name).eval().requires_grad_(False)
    return ema
