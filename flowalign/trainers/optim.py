"""What the loop optimises and where it stands: the trainable parameters, AdamW, the EMA, the learning-rate
schedule and the step counter, and one optimiser step (gradients reduced over ranks, clipped, stepped,
EMA updated).

:func:`setup_optimisation` is the one place where the model's trainable tensors meet the optimiser, so
a sharding or offloading scheme hooks in there (through the run's :class:`flowalign.parallel.Parallel`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from flowalign.ema import EMA
from flowalign.errors import UserError
from flowalign.parallel import Parallel
from flowalign.protocols import FlowPolicy


@dataclass
class Schedule:
    """The learning rate: ``trainer.lr`` with its warm-up and decay, and the rate of the step in flight.

    The one place the LR lives: :meth:`begin_step` computes it, writes it into the optimiser's parameter
    groups and keeps it as :attr:`lr` (what ``train/lr`` logs).
    """

    base: float
    kind: str = "constant"
    warmup_steps: int = 0
    min_ratio: float = 0.1
    #: the cosine's length in steps, then ``min_ratio·base`` held; None: the cosine spans the run's budget
    decay_steps: int | None = None
    #: the warm-up's first factor ``s`` (``s + (1 − s)·step/warmup_steps``); None: ``(step + 1)/warmup_steps``
    warmup_start: float | None = None
    #: the LR of the current step (``base`` until the first step begins)
    lr: float = field(init=False)

    def __post_init__(self) -> None:
        self.lr = self.base

    @classmethod
    def of(cls, tcfg: Any) -> Schedule:
        """The schedule of a trainer config (``lr``, ``lr_schedule``, ``lr_warmup_steps``, ``lr_min_ratio``,
        ``lr_decay_steps``, ``lr_warmup_start``)."""
        return cls(tcfg.lr, tcfg.lr_schedule, tcfg.lr_warmup_steps, tcfg.lr_min_ratio, tcfg.lr_decay_steps,
                   tcfg.lr_warmup_start)

    def at(self, step: int, fraction: float) -> float:
        """The LR of ``step`` at a budget fraction in [0, 1]: linear warm-up over ``warmup_steps`` (from
        ``warmup_start·base`` where given), then constant or cosine down to ``min_ratio·base`` (over the budget,
        or over ``decay_steps`` steps and then held there)."""
        lr = self.base
        if self.decay_steps is not None:
            fraction = min(1.0, step / self.decay_steps)
        if self.kind == "cosine":
            lr *= self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * fraction))
        if step < self.warmup_steps:
            start = self.warmup_start
            lr *= (step + 1) / self.warmup_steps if start is None else start + (1 - start) * step / self.warmup_steps
        return lr

    def begin_step(self, optimizer: torch.optim.Optimizer, step: int, fraction: float) -> float:
        """Set the LR of ``step`` (:meth:`at`) in ``optimizer`` and keep it as :attr:`lr`; returns it."""
        self.lr = self.at(step, fraction)
        for group in optimizer.param_groups:
            group["lr"] = self.lr
        return self.lr


@dataclass
class Optimisation:
    """The trainable tensors, their optimiser, (``ema_decay > 0``) their EMA, the LR schedule and the count
    of training steps done: the state a checkpoint saves and resume restores."""

    params: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    ema: EMA | None
    #: how the weights are spread over ranks (replicated or FSDP2 shards)
    parallel: Parallel
    schedule: Schedule
    grad_clip: float
    #: training steps done (the schedule's, the noise's and the checkpoints' step)
    step: int = 0
    #: the trainer's parameter groups by name (:func:`setup_optimisation`'s ``groups``), each its own group of
    #: the optimiser, which :meth:`optimizer_step` can step alone; empty: one group of every parameter
    groups: dict[str, list[torch.nn.Parameter]] = field(default_factory=dict)

    def begin_step(self, fraction: float) -> float:
        """The LR of the coming step at budget ``fraction``, set in the optimiser (see :class:`Schedule`)."""
        return self.schedule.begin_step(self.optimizer, self.step, fraction)

    def optimizer_step(self, group: str | None = None) -> torch.Tensor:
        """Reduce gradients over ranks, clip to ``grad_clip``, step at the schedule's LR, update the EMA;
        returns the pre-clip gradient norm (0-dim, on the device: not read back here). A tensor that no unit
        of the step reached (a step of zero-advantage samples only) steps on a zero gradient, as it does where
        another rank's units reached it: AdamW's moments and weight decay move it in every rank layout.

        ``group`` (a name of :attr:`groups`): that group's tensors alone are reduced, clipped to ``grad_clip``
        by their own norm and stepped; the other groups' gradients are dropped first, so their weights and
        AdamW moments stay as they are (AdamW skips a tensor without a gradient): a step of one group is what a
        separate optimiser of that group would do. The EMA moves after every optimiser step, a group's too."""
        params = self.params
        if group is not None:
            if group not in self.groups:
                raise ValueError(f"no parameter group {group!r}; the trainer's groups are {sorted(self.groups)}")
            params = self.groups[group]
            mine = {id(p) for p in params}
            for p in self.params:
                if id(p) not in mine:
                    p.grad = None
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        self.parallel.reduce_gradients(params)
        norm = self.parallel.clip_grad_norm(params, self.grad_clip)
        if self.ema is not None:
            self.ema.before_step()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.ema is not None:
            self.ema.update()
        return norm


def setup_optimisation(policy: FlowPolicy, tcfg: Any, parallel: Parallel,
                       groups: Callable[[str, torch.nn.Parameter], str] | None = None) -> Optimisation:
    """AdamW over the policy's ``requires_grad`` parameters (``tcfg``: lr and its schedule, betas,
    weight_decay, optimizer_kernel, grad_clip and the ``ema_*`` settings); under fsdp the transformer is
    sharded first, so they are this rank's shards.

    ``groups`` (the trainer's :meth:`~flowalign.trainers.base.GroupTrainer.parameter_groups`): the name of the
    group of each trainable tensor (its name in ``policy.trainable``, the tensor); each group becomes a
    parameter group of the AdamW (the same lr, betas and weight decay) that an optimiser step can clip and
    step alone (:meth:`Optimisation.optimizer_step`). None: one group, one clip, as every trainer has."""
    if getattr(policy, "streaming", False) and parallel.layout.sequence > 1:
        raise UserError(f"parallel.sequence_parallel={parallel.layout.sequence}: a streaming model's chunks attend to "
                        "a KV cache its policy hands each block, which a split sequence does not carry; use "
                        "parallel.sequence_parallel=1 (data ranks still share the work)")
    parallel.shard(policy.trainable)
    named = [(n, p) for n, p in policy.trainable.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    if not params:
        raise UserError("the policy has no trainable parameters; set model.finetune to lora or full")
    by_group: dict[str, list[torch.nn.Parameter]] = {}
    if groups is not None:
        for name, p in named:
            by_group.setdefault(groups(name, p), []).append(p)
    optimizer = adamw([{"params": ps, "name": g} for g, ps in by_group.items()] if by_group else params, tcfg)
    ema = (EMA(params, tcfg.ema_decay, tcfg.ema_every, tcfg.ema_warmup, tcfg.ema_micro_batches)
           if tcfg.ema_decay > 0 else None)
    return Optimisation(params, optimizer, ema, parallel, Schedule.of(tcfg), tcfg.grad_clip, groups=by_group)


def adamw(params: list[torch.nn.Parameter] | list[dict[str, Any]], tcfg: Any) -> torch.optim.AdamW:
    """AdamW at ``tcfg``'s lr, betas and weight decay, with the kernels of ``tcfg.optimizer_kernel``, over
    ``params`` (tensors, or parameter groups: dicts with ``params``)."""
    fused = True if tcfg.optimizer_kernel == "fused" else None  # None: PyTorch picks
    return torch.optim.AdamW(params, lr=tcfg.lr, betas=tcfg.betas, weight_decay=tcfg.weight_decay, fused=fused)
