"""KVPO's policy over a group's branches and its clipped objective (the authors' ``per_step`` mode).

A branch's score replays its denoising under the full history: with ``x0 = x_t − σ_t·v`` (their Wan
wrapper's conversion), the branch's own ``x̂0_t`` (from the velocity ``u_t`` it took) and the policy's
(from ``v_θ``), ``s_i = Σ_t −mean_D (x̂0_branch − x̂0_θ)² / (2·max(σ_t, floor)²)`` (``_compute_trajectory_log_prob``
with ``_get_sigma_for_timestep``): at the floor 1 each step's velocity error weighs ``σ_t²/2``. The policy
is ``π = softmax(s)``; the objective (``_compute_policy_objective_from_logits``, ``mechanism_2``) is

    L = (1 − π_anchor) · ( −mean_i min(r_i·A_i, clip(r_i, 1 − ε_low, 1 + ε_high)·A_i) + β · KL(π_θ ‖ π_init) )

with ``r = π_θ/π_old`` (log-ratio clamped to ±20) and ``π_anchor`` the mass of an anchor slot of logit 0
appended to ``log π_θ`` when no branch beat the anchor (logit −∞, so a scale of 1, when one did). The
slot's logit 0 beside a log-softmax (whose exponentials sum to 1) makes ``π_anchor = 1/2`` exactly: the loss
of a group that did not beat its anchor is halved, with no gradient through the scale.
"""

from __future__ import annotations

import torch

#: their log-ratio clamp before exponentiating
LOG_RATIO_CLAMP = 20.0


def x0_scores(v: torch.Tensor, u: torch.Tensor, sigmas: torch.Tensor, floor: float) -> torch.Tensor:
    """``s (G,)``: ``Σ_t −mean_D (σ_t·(u_t − v_t))² / (2·max(σ_t, floor)²)`` of the policy's velocities ``v (G, T, ...)``
    against the branches' ``u (G, T, ...)`` (``σ_t·(u − v)`` is the x0 difference, the states cancelling);
    ``sigmas (T+1,)`` the grid."""
    s = sigmas[:-1].to(v, non_blocking=True)
    x0_gap = (u.detach() - v) * s.view(1, -1, *[1] * (v.ndim - 2))
    mse = x0_gap.pow(2).flatten(2).mean(2)  # (G, T)
    weight = (2.0 * s.clamp(min=floor) ** 2).clamp(min=2e-10)
    return -(mse / weight).sum(1)


def anchor_slot_scale(log_pi: torch.Tensor, safe: bool) -> torch.Tensor:
    """``1 − π_anchor`` with ``π_anchor = softmax([log π, 0 or −∞])[−1]`` (``_per_step_mechanism2_anchor_scale_entropy``):
    1 when some branch beat the anchor (``safe``), else the anchor slot's complement."""
    slot = torch.full((1,), float("-inf") if safe else 0.0, dtype=log_pi.dtype, device=log_pi.device)  # filled there: no copy
    return 1.0 - torch.softmax(torch.cat([log_pi, slot]), 0)[-1]


def discrete_kl(log_pi: torch.Tensor, log_ref: torch.Tensor) -> torch.Tensor:
    """``KL(π ‖ π_ref) = Σ π·(log(π + 1e-10) − log π_ref)`` over the branches (``_discrete_kl_pi_vs_log_ref``)."""
    pi = log_pi.exp()
    return (pi * (torch.log(pi + 1e-10) - log_ref)).sum()


def branch_objective(scores: torch.Tensor, old_scores: torch.Tensor, advantages: torch.Tensor, clip_low: float,
                     clip_high: float, kl_coef: float = 0.0, init_scores: torch.Tensor | None = None,
                     safe: bool = True) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss (a scalar) over one group's branch logits ``scores (G,)`` (differentiable), ``old_scores (G,)``
    and ``init_scores (G,)`` (the sampling and the initial weights'), ``advantages (G,)``; with the ratio's
    largest deviation from 1, the clipped fraction, the KL and the anchor scale."""
    log_pi = torch.log_softmax(scores, 0)
    old = torch.log_softmax(old_scores.detach(), 0)
    ratio = torch.exp((log_pi - old).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    clipped = ratio.clamp(1 - clip_low, 1 + clip_high)
    loss = -torch.minimum(ratio * advantages, clipped * advantages).mean()
    kl = torch.zeros((), dtype=loss.dtype, device=loss.device)
    if kl_coef:
        if init_scores is None:
            raise ValueError("branch_objective: kl_coef > 0 needs the initial weights' init_scores")
        kl = discrete_kl(log_pi, torch.log_softmax(init_scores.detach(), 0))
        loss = loss + kl_coef * kl
    scale = anchor_slot_scale(log_pi, safe)
    info = {"ratio_dev": (ratio.detach() - 1).abs().max(),
            "clip_fraction": ((ratio.detach() - clipped.detach()).abs() > 1e-6).float().mean(),
            "kl": kl.detach(), "anchor_scale": scale.detach()}
    return scale * loss, info


def velocity_energy(v: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Trajectory Velocity Energy ``(G,)``: ``mean_{t,D} (v − sg(u))²`` of the policy's velocities ``v (G, T, ...)``
    against the branches' own ``u (G, T, ...)`` (flowalign's earlier, unweighted score; logits ``−E/τ``)."""
    return ((v - u.detach()) ** 2).flatten(1).mean(1)
