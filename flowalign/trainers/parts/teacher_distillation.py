"""Velocity distillation on routed teachers: the batch of states and target velocities, how its states are
drawn, and its loss (Flow-OPD's ``objective: velocity_distillation`` and its flow-matching cold start,
``docs/methods/flow_opd.md``). With ``λ`` the anchor's weight and both targets detached,

    L_i = 1[i routed] · mean_k ‖v_θ(x_k) − v_T(i)(x_k)‖² + λ · mean_k ‖v_θ(x_k) − v_A(x_k)‖²
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from flowalign.protocols import Conditioning
from flowalign.trainers.parts.reductions import per_sample_mean
from flowalign.trainers.parts.timesteps import pair_timesteps


@dataclass
class DistillBatch:
    """This rank's states and targets: ``x (B, S, ...)`` at ``sigma (B, S)`` with the teacher and anchor
    velocities there (cold start: S = 1, the teacher's samples noised, the target ε − x0), ``routed (B,)``."""

    x: torch.Tensor
    sigma: torch.Tensor
    v_teacher: torch.Tensor
    v_anchor: torch.Tensor | None
    routed: torch.Tensor
    cond: Conditioning
    #: the CFG scale the student's velocity is read at (the teachers' in distillation; 1 in the cold start)
    guidance: float
    logs: dict[str, Any] = field(default_factory=dict)


def cold_start_batch(x0: torch.Tensor, generators: list[torch.Generator], cond: Conditioning) -> DistillBatch:
    """The flow-matching cold start on teacher samples ``x0 (B, ...)``: each noised at a logit-normal ``t`` by
    noise ``ε``, both drawn from its own generator (``t`` first), as one state ``x_t = (1 − t)·x0 + t·ε`` whose
    target is the flow-matching velocity ``ε − x0``; every sample trained, the velocity read at CFG scale 1."""
    t, eps = [], []
    for g in generators:
        t.append(pair_timesteps(1, "logit_normal", g))
        eps.append(torch.randn(x0.shape[1:], generator=g))
    t, eps = torch.cat(t).to(x0), torch.stack(eps).to(x0)
    tb = t.view(-1, *[1] * (x0.ndim - 1))
    return DistillBatch(((1 - tb) * x0 + tb * eps)[:, None], t[:, None], (eps - x0)[:, None], None,
                        torch.ones(len(x0)), cond, 1.0, {"stage": 0.0})


def drawn_states(latents: torch.Tensor, sigmas: torch.Tensor, count: int,
                 generators: list[torch.Generator]) -> tuple[torch.Tensor, torch.Tensor]:
    """``x (B, S, ...)`` and ``sigma (B, S)``: ``S = count`` of each rollout's ``T`` visited states ``latents
    (B, T, ...)`` at ``sigmas (T,)``, drawn without repeat by the rollout's own generator, in step order."""
    picks = torch.stack([torch.randperm(len(sigmas), generator=g)[:count].sort().values for g in generators])
    return torch.stack([latents[n, picks[n]] for n in range(len(picks))]), sigmas[picks]


def distillation_loss(v: torch.Tensor, v_teacher: torch.Tensor, v_anchor: torch.Tensor | None,
                      routed: torch.Tensor, anchor_weight: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-sample ``1[routed]·mean‖v − sg(v_T)‖² + λ·mean‖v − sg(v_A)‖²`` ``(B,)`` for velocities ``(B, ...)``."""
    teacher = per_sample_mean((v - v_teacher.detach()) ** 2) * routed.to(v, non_blocking=True)
    loss, info = teacher, {"loss_teacher": teacher.detach().mean()}
    if v_anchor is not None and anchor_weight > 0:
        anchor = per_sample_mean((v - v_anchor.detach()) ** 2)
        loss = loss + anchor_weight * anchor
        info["loss_anchor"] = anchor.detach().mean()
    return loss, info


def states_loss(velocity: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], x: torch.Tensor, sigma: torch.Tensor,
                v_teacher: torch.Tensor, v_anchor: torch.Tensor | None, routed: torch.Tensor,
                anchor_weight: float) -> tuple[torch.Tensor, dict[str, Any]]:
    """:func:`distillation_loss` ``(B,)`` averaged over the ``S`` states ``x (B, S, ...)`` at ``sigma (B, S)``
    (targets ``(B, S, ...)``), the student's velocity at a state read by ``velocity(x_s, sigma_s)``; and its
    terms' means, averaged likewise."""
    per = torch.zeros(len(x), device=x.device)
    stats: dict[str, Any] = {}
    for s in range(x.shape[1]):
        v = velocity(x[:, s], sigma[:, s])
        anchor = None if v_anchor is None else v_anchor[:, s]
        loss, info = distillation_loss(v, v_teacher[:, s], anchor, routed, anchor_weight)
        per = per + loss / x.shape[1]
        for k, val in info.items():
            stats[k] = stats.get(k, 0.0) + val / x.shape[1]
    return per, stats
