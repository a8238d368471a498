"""TempFlow-GRPO's temporal structure (``docs/methods/tempflow_grpo.md``): where a group branches, and how
much each branching step weighs.

A group branches at a step ``k``: every member starts from the group's ``x_T``, follows the ODE to
``x_k`` (the same for all members), takes one SDE step there (its own noise), and follows the ODE again
to the end. The rewards of the group then differ only through that one stochastic step, so the group's
advantages credit step ``k`` alone (a process reward without an intermediate reward model). The authors
branch every trajectory at every candidate step; a group may also branch at one drawn step.

A step's exploration is the std ``τ_k`` of its Gaussian: early, noisy steps move the sample far, late ones
barely. The noise-aware weight of step ``k`` among the candidate steps ``K`` is ``w_k = τ_k / mean_{j∈K} τ_j``
(mean 1 over ``K``, so the learning rate keeps its meaning).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from flowalign.sampling.steps import flow_grpo_diffusion


def branch_candidates(num_steps: int, steps: Sequence[int] | None) -> list[int]:
    """The steps a group may branch at: ``steps`` (sorted, distinct), or every step but the last (the step
    to σ = 0, deterministic in the rollouts) when None. Raises ``ValueError`` for a step outside
    ``0 … num_steps − 2``."""
    if steps is None:
        return list(range(num_steps - 1))
    out = sorted(set(int(k) for k in steps))
    if not out or out[0] < 0 or out[-1] > num_steps - 2:
        raise ValueError(f"branch steps {list(steps)} must be non-empty and within 0..{num_steps - 2} "
                         f"(the last of the {num_steps} steps is deterministic)")
    return out


def draw_branch_step(candidates: Sequence[int], generator: torch.Generator) -> int:
    """One candidate drawn uniformly from ``generator`` (seed it by the group, so every rank draws alike)."""
    return int(candidates[int(torch.randint(len(candidates), (1,), generator=generator))])


def step_noise_std(sampler: str, sigma: float, sigma_next: float, noise_level: float) -> float:
    """The std ``τ`` of one SDE step's Gaussian: ``s·sqrt(σ − σ')`` with Flow-GRPO's ``s = a·sqrt(σ/(1−σ))``
    (``"flow_grpo"``) or DanceGRPO's constant ``s = η`` (``"dance"``)."""
    if sampler == "flow_grpo":
        s = float(flow_grpo_diffusion(sigma, sigma_next, noise_level))
    elif sampler == "dance":
        s = noise_level
    else:
        raise ValueError(f"noise-aware weights need a Gaussian SDE step (flow_grpo or dance), not {sampler!r}")
    return s * math.sqrt(sigma - sigma_next)


def noise_aware_weights(sigmas: torch.Tensor, candidates: Sequence[int], sampler: str,
                        noise_level: float, scale: float | None = None) -> dict[int, float]:
    """``{k: τ_k / mean_{j∈candidates} τ_j}`` for the candidate steps of the grid ``sigmas`` ``(T+1,)``, or
    ``{k: scale·τ_k}`` with a fixed ``scale`` (the authors' SD3.5 script: 2.25, about 1 / mean τ on its
    10-step grid)."""
    stds = {k: step_noise_std(sampler, float(sigmas[k]), float(sigmas[k + 1]), noise_level) for k in candidates}
    if scale is not None:
        return {k: scale * s for k, s in stds.items()}
    mean = sum(stds.values()) / len(stds)
    return {k: s / mean for k, s in stds.items()}
