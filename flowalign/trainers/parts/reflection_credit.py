"""Credit of whole reflection trajectories (``docs/methods/umm_reflection.md``): a trajectory's scalar reward
from the scores of its image states, one group-relative advantage per trajectory, and how a trajectory's
text turns and revisions share its weight in the loss.

The reward (UMM-Reflection's released trainer) of a trajectory with image states scored ``q_0 … q_T`` (``q_0``
the shared first image, one state per revision):

    R = q_T + α Σ_t [q_{t+1} − q_t]_+ + β (Σ of the positive improvements but the largest)
            − λ Σ_t [q_t − q_{t+1}]_+ − p · 1[the model stopped on an image scoring below 1]

and its advantage ``A_i = clip((R_i − mean_g R) / max(std_g R, floor), −c, c)`` over the siblings sharing the
first image (population std). The same scalar weighs every term of the trajectory.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

import torch

from flowalign.errors import UserError


@dataclass(frozen=True)
class ShapedCredit:
    """The coefficients of the shaped trajectory reward and of its group normalisation."""

    #: α: weight of each round's improvement
    reflection_bonus: float = 0.3
    #: λ: weight of each round's regression
    regression_penalty: float = 0.5
    #: β: weight of the improvements beyond the largest one (improving on more than one round)
    sustained_bonus: float = 0.3
    #: p: charged when the model itself stopped on an image scoring below 1
    premature_stop_penalty: float = 0.5
    #: floor of the group's reward std (a near-constant group does not blow its advantages up)
    std_floor: float = 0.1
    #: c: the advantage is clipped to [−c, c]
    clip: float = 1.0


def trajectory_reward(states: Sequence[float], premature_stop: bool, credit: ShapedCredit) -> float:
    """``R`` of one trajectory from its image states' scores ``q_0 … q_T`` (each in [0, 1])."""
    q = [float(v) for v in states]
    deltas = [b - a for a, b in pairwise(q)]
    gains = sorted(d for d in deltas if d > 0)
    return (q[-1] + credit.reflection_bonus * sum(gains) + credit.sustained_bonus * sum(gains[:-1])
            - credit.regression_penalty * sum(-d for d in deltas if d < 0)
            - (credit.premature_stop_penalty if premature_stop else 0.0))


def trajectory_rewards(scores: torch.Tensor, counts: torch.Tensor, premature_stop: torch.Tensor,
                       credit: ShapedCredit) -> torch.Tensor:
    """``R (N,)`` float64 of trajectories whose state scores are ``scores (N, S)`` (row ``i``: its first
    ``counts[i]`` entries, ``q_0`` first), ``premature_stop (N,)`` bool. Scores outside [0, 1] are refused: the
    bonus and penalty weights are sized for a score in [0, 1] (1: the prompt is satisfied)."""
    bad = [float(v) for i, c in enumerate(counts.tolist()) for v in scores[i, :c].tolist()
           if not 0.0 <= float(v) <= 1.0]
    if bad:
        raise UserError(f"trainer.credit=shaped needs rewards in [0, 1] (1: the prompt is satisfied), got {bad[0]:g}; "
                        "use rewards scored in [0, 1] (e.g. partial_credit: true) or trainer.credit=final")
    return torch.tensor([trajectory_reward(scores[i, :c].tolist(), bool(premature_stop[i]), credit)
                         for i, c in enumerate(counts.tolist())], dtype=torch.float64)


def shaped_advantages(rewards: torch.Tensor, groups: torch.Tensor, credit: ShapedCredit,
                      valid: torch.Tensor | None = None) -> torch.Tensor:
    """``A (N,)`` float64: each reward's z-score within its group (siblings sharing a first image; population
    std floored at ``credit.std_floor``), clipped to ``±credit.clip``. Invalid trajectories (``valid (N,)``
    False) take no part in their group's statistics and get 0."""
    r = rewards.double()
    ok = torch.ones(len(r), dtype=torch.bool) if valid is None else valid.bool()
    out = torch.zeros_like(r)
    for g in groups.unique().tolist():
        members = (groups == g) & ok
        if not members.any():
            continue
        values = r[members]
        scale = values.std(unbiased=False).clamp(min=credit.std_floor)
        out[members] = ((values - values.mean()) / scale).clamp(-credit.clip, credit.clip)
    return out


def channel_scales(records: torch.Tensor, active: int | None = None) -> torch.Tensor:
    """``(N,)`` float64: the weight of each record (a text turn, or a revision) of a trajectory with
    ``records (N,)`` of them, ``1 / (active · records_i)``: a trajectory's records share its weight equally, and
    the trajectories that have any (``active``, over every rank; default: those here) share the channel's
    (0 for a trajectory with none)."""
    counts = records.double()
    active = int((records > 0).sum()) if active is None else int(active)
    return torch.where(records > 0, 1.0 / (max(active, 1) * counts.clamp(min=1)), torch.zeros_like(counts))
