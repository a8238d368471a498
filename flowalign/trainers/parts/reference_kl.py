"""KL terms to the frozen starting model of a unified policy's two roles (``docs/methods/umm_reflection.md``),
as UMM-Reflection's released trainer computes them.

Text: per written token ``d = log π_θ(y_t) − log π_ref(y_t)`` (both at the sampling temperature), the k3
estimator ``k3(d) = exp(d) − 1 − d`` with the exponential continued linearly above ``d = 10`` nats (value and
slope agree there, so the term keeps pulling a runaway token back instead of overflowing), averaged over
the reflection's tokens. Image: per revision step, the KL between the policy's and the reference's Gaussian
transitions of equal variance, ``mean_D (μ_θ − μ_ref)² / (2τ²)`` (``τ`` the step's noise std).
"""

from __future__ import annotations

import math

import torch

#: above this many nats the exponential of the text k3 is continued linearly (the authors' threshold)
LINEAR_ABOVE = 10.0


def bounded_exp(delta: torch.Tensor, threshold: float = LINEAR_ABOVE) -> torch.Tensor:
    """``exp(d)`` for ``d ≤ threshold``, ``exp(threshold)·(1 + d − threshold)`` above (same shape as ``delta``)."""
    excess = (delta - threshold).clamp(min=0.0)
    return torch.exp(delta - excess) + math.exp(threshold) * excess


def token_k3(log_probs: torch.Tensor, reference_log_probs: torch.Tensor,
             threshold: float = LINEAR_ABOVE) -> torch.Tensor:
    """Per-token ``k3(d) = bexp(d) − 1 − d``, ``d = log π_θ − log π_ref`` (same shape as the inputs, ≥ 0, 0
    where the two agree). The reflection's term is its mean over tokens."""
    delta = log_probs - reference_log_probs.to(log_probs)
    return bounded_exp(delta, threshold) - 1.0 - delta


def transition_kl(mean: torch.Tensor, reference_mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """``(B,)``: ``mean_D (μ_θ − μ_ref)² / (2τ²)`` between two Gaussian steps of the same std ``τ``
    (``mean``, ``reference_mean`` ``(B, ...)``; ``std`` broadcastable to them)."""
    return ((mean - reference_mean.to(mean)) ** 2 / (2 * std.to(mean) ** 2)).flatten(1).mean(1)
