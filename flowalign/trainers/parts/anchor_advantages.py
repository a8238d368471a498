"""Anchor-relative advantages (KVPO): a branch's reward against the unrouted rollout of the same noise.

Their ``_anchor_advantage`` per reward, ``(r_i − r_anchor) / (std(r_1..r_G, r_anchor) + 1e-8)`` with the
unbiased std over the branches and the anchor, summed over the rewards with their weights
(``_aggregate_component_advantages``); then ``_normalize_advantage_for_fusion`` in its ``std`` mode (divided
by the population std, left as it is when that is ≤ 1e-8), times the signal's weight; the signals (the
routed chunk's, *local*, and the whole video's, *global*) summed (``_fuse_signal_advantages``), clamped to
``±adv_clip`` (``train_step``). The sign says whether a branch beat the anchor: these do not sum to zero.
"""

from __future__ import annotations

from collections.abc import Sequence

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


def fused_anchor_advantages(signals: Sequence[tuple[torch.Tensor, torch.Tensor, float]], weights: torch.Tensor,
                            clip: float) -> torch.Tensor:
    """The advantages ``(G,)`` KVPO trains on: per signal ``(values (G, M), anchor (M,), signal_weight)`` (theirs:
    the routed chunk's frames, the *local* signal, and the whole video's, the *global* one), the weighted anchor
    advantages, std-normalised and weighted (``_fuse_signal_advantages``), summed over the signals, then
    clamped to ``±clip`` (0: no clamp)."""
    fused = sum(std_fused(weighted_anchor_advantages(values, anchor, weights), w) for values, anchor, w in signals)
    return fused.clamp(-clip, clip) if clip > 0 else fused
