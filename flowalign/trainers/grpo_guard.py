"""GRPO-Guard (arXiv 2510.22319): Flow-GRPO with a regulated clip (``docs/methods/grpo_guard.md``).

For a Gaussian step ``x' ~ N(μ, τ²)`` stored with ``x' = μ_old + τ·ξ``, Flow-GRPO's log-ratio is
``ℓ_θ − ℓ_old = mean_D(ξ·Δμ)/τ − mean_D(Δμ²)/(2τ²)`` with ``Δμ = μ_θ − μ_old``: its second term shifts the
ratio below 1 whenever the policy moved, and its scale ``1/τ`` differs from step to step, so the clip acts
unevenly. GRPO-Guard's ratio normalisation adds the shift back and multiplies by ``τ``:

    r̃ = exp((ℓ_θ − ℓ_old + mean_{B,D}(Δμ²)/(2τ²))·τ)

and its gradient reweighting divides each step's clipped surrogate by ``h = σ_k − σ_{k+1}`` (``Δμ`` scales
with ``h``), so no band of noise levels dominates the update:

    L = mean_{i,k} (1/h_k)·max(−A_i·r̃, −A_i·clip(r̃, 1−ε, 1+ε)) + β·KL

``μ_old`` is the rollout's own step mean, from the velocities the rollout keeps. The authors' code averages
the shift ``Δμ²`` over the whole micro-batch as well as over the elements (its ``mean(dim=tuple(range(1,
log_prob.ndim)))`` runs on a per-sample log-prob, so it reduces every dimension); here the micro-batch is
the chunk's samples with a non-zero advantage (the authors drop the others before batching).
``ratio_bias: sample`` takes each sample's own shift instead, so that ``r̃ = exp(mean_D(ξ·Δμ))``.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch
from pydantic import Field

from flowalign.limits import MAX_COEFFICIENT
from flowalign.sampling import Rollout, StepOutput
from flowalign.trainers.base import Sampling
from flowalign.trainers.flow_grpo import (FlowGRPOBase, FlowGRPOTrainer, SDEOptions, SDEWindowOptions,
                                           StepFractionOptions, StepSubsetOptions)
from flowalign.trainers.options import ReferenceOptions
from flowalign.trainers.parts.reductions import masked_mean


class GRPOGuardConfig(FlowGRPOBase, ReferenceOptions, SDEOptions, SDEWindowOptions, StepFractionOptions,
                      StepSubsetOptions):
    name: Literal["grpo_guard"] = "grpo_guard"  # type: ignore[assignment]
    #: what runs saved before these options existed computed (see TrainerConfig.before)
    before = {"ratio_bias": "sample"}
    #: the ratio normalisation and the reweighting need a Gaussian step: the Flow-GRPO SDE
    sampler: Literal["flow_grpo"] = "flow_grpo"  # type: ignore[assignment]
    #: r̃ = exp((ℓ_θ − ℓ_old + mean(Δμ²)/(2τ²))·τ) instead of exp(ℓ_θ − ℓ_old)
    ratio_norm: bool = True
    #: the mean of Δμ² in r̃: over the chunk's samples and elements ("batch", as the authors' code computes
    #: it) or over each sample's own elements ("sample": r̃ = exp(mean_D(ξ·Δμ)) per sample)
    ratio_bias: Literal["batch", "sample"] = "batch"
    #: each step's surrogate divided by its σ gap h = σ_k − σ_{k+1}
    reweight: bool = True
    beta: float = Field(0.0, ge=0, le=MAX_COEFFICIENT)


def guard_ratio(log_prob: torch.Tensor, old_log_prob: torch.Tensor, mean: torch.Tensor, old_mean: torch.Tensor,
                std: torch.Tensor, bias_over: Literal["batch", "sample"] = "batch",
                active: torch.Tensor | None = None) -> torch.Tensor:
    """GRPO-Guard's normalised ratio ``(B,)``: ``exp((ℓ_θ − ℓ_old + mean(μ_θ − μ_old)²/(2τ²))·τ)``, with
    ``ℓ`` the per-element mean Gaussian log-densities ``(B,)``, ``μ`` ``(B, ...)`` and ``τ`` ``(B,)`` (equal
    across the batch, one step). The mean of the shift runs over every sample and element (``"batch"``, the
    authors' code; over the ``active`` samples ``(B,)`` bool when any, as the authors drop samples with a
    zero advantage before batching) or over each sample's elements (``"sample"``)."""
    shift = ((mean - old_mean) ** 2).flatten(1).mean(1)
    if bias_over == "batch":
        if active is not None:  # masked, not indexed: no host wait (the batch's mean where none is active)
            shift = torch.where(active.any(), masked_mean(shift, active), shift.mean()).expand_as(shift)
        else:
            shift = shift.mean().expand_as(shift)
    return torch.exp((log_prob - old_log_prob + shift / (2 * std**2)) * std)


def guard_clip_loss(ratio: torch.Tensor, adv: torch.Tensor, clip_range: float, step_weight: float,
                    weight: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample ``(1/h)·max(−w·A·r̃, −w·A·clip(r̃, 1−ε, 1+ε))`` ``(B,)`` (``step_weight`` = 1/h, or 1) and the
    clipped flag."""
    scaled = adv if weight is None else adv * weight
    unclipped = -scaled * ratio
    clipped = -scaled * torch.clamp(ratio, 1 - clip_range, 1 + clip_range)
    return step_weight * torch.maximum(unclipped, clipped), clipped > unclipped


class GRPOGuardTrainer(FlowGRPOTrainer):
    Config = GRPOGuardConfig
    tcfg: GRPOGuardConfig

    @classmethod
    def keeps_velocities(cls, tcfg) -> bool:
        return tcfg.ratio_norm  # the normalised ratio reads the rollout's velocities

    def sampling(self, group: int) -> Sampling:
        """Flow-GRPO's, keeping each step's velocity (the old policy's step mean ``μ_old``)."""
        return dataclasses.replace(super().sampling(group), keep_velocities=self.tcfg.ratio_norm)

    def surrogate(self, chunk: Rollout, k: int, out: StepOutput, old_log_prob: torch.Tensor, adv: torch.Tensor,
                  weight: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.tcfg.ratio_norm:
            with torch.no_grad():
                old = self.step_distribution(chunk, k, chunk.velocities[:, k].to(out.mean))
            std = out.std.flatten(1)[:, 0].expand(len(adv))
            ratio = guard_ratio(out.log_prob, old_log_prob, out.mean, old.mean, std, self.tcfg.ratio_bias,
                                active=adv != 0)
        else:
            ratio = torch.exp(out.log_prob - old_log_prob)
        gap = chunk.sigmas[k].item() - chunk.sigmas[k + 1].item()
        per_sample, clipped = guard_clip_loss(ratio, adv, self.tcfg.clip_range,
                                              1.0 / gap if self.tcfg.reweight else 1.0, weight)
        return per_sample, ratio, clipped
