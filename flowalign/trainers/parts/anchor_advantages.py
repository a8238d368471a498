"""Anchor-relative advantages (KVPO): a branch's reward against the unrouted rollout of the same noise.

Their ``_anchor_advantage`` per reward, ``(r_i − r_anchor) / (std(r_1..r_G, r_anchor) + 1e-8)`` with the
unbiased std over the branches and the anchor, summed over the rewards with their weights
(``_aggregate_component_advantages``); then ``_normalize_advantage_for_fusion`` in its ``std`` mode (divided
by the population std, left as it is when that is ≤ 1e-8), times the signal's weight, clamped to
``±adv_clip`` (``train_step``). The sign says whether a branch beat the anchor: these do not sum to zero.
"""

from __future__ import annotations

import torch

EPS = 1e-8


def anchor_advantage(rewards: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
    """``(r − r_anchor) / (std(r, r_anchor) + 1e-8)`` ``(G,)`` of one reward's ``rewards (G,)`` and ``anchor ()``."""
    spread = torch.cat([rewards, anchor.reshape(1)]).std() + EPS
    return (rewards - anchor) / spread


def weighted_anchor_advantages(values: torch.Tensor, anchor: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``Σ_m w_m · anchor_advantage(values[:, m], anchor[m])`` ``(G,)``: ``values (G, M)``, ``anchor (M,)``,
    ``weights (M,)``, each reward's advantage on its own scale."""
    return sum(weights[m] * anchor_advantage(values[:, m], anchor[m]) for m in range(values.shape[1]))


def std_fused(advantages: torch.Tensor, weight: float) -> torch.Tensor:
    """One signal's advantages ``(G,)`` divided by their population std (unless it is ≤ 1e-8), times ``weight``."""
    std = advantages.std(unbiased=False)
    scaled = advantages if std <= EPS else advantages / (std + EPS)
    return scaled * weight


def fused_anchor_advantages(values: torch.Tensor, anchor: torch.Tensor, weights: torch.Tensor, signal_weight: float,
                            clip: float) -> torch.Tensor:
    """The advantages ``(G,)`` KVPO trains on, from one signal's per-reward ``values (G, M)`` and ``anchor (M,)``."""
    fused = std_fused(weighted_anchor_advantages(values, anchor, weights), signal_weight)
    return fused.clamp(-clip, clip) if clip > 0 else fused
