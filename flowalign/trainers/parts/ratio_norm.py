"""GRPO-Guard's ratio normalisation and step reweighting, for the Flow-GRPO trainers that use it (GRPO-Guard;
Pref-GRPO, whose scripts turn it on with ``--rationorm``) (``docs/methods/grpo_guard.md``).

For a Gaussian step ``x' ~ N(μ, τ²)`` stored with ``x' = μ_old + τ·ξ``, Flow-GRPO's log-ratio is
``ℓ_θ − ℓ_old = mean_D(ξ·Δμ)/τ − mean_D(Δμ²)/(2τ²)`` with ``Δμ = μ_θ − μ_old``: its second term shifts the
ratio below 1 whenever the policy moved, and its scale ``1/τ`` differs from step to step, so the clip acts
unevenly. The normalisation adds the shift back and multiplies by ``τ``:

    r̃ = exp((ℓ_θ − ℓ_old + mean(Δμ²)/(2τ²))·τ)

and the reweighting divides each step's clipped surrogate by ``h = σ_k − σ_{k+1}`` (``Δμ`` scales with ``h``):

    L = mean_{i,k} (1/h_k)·max(−A_i·r̃, −A_i·clip(r̃, 1−ε, 1+ε))

``μ_old`` is the rollout's own step mean, from the velocities the rollout keeps. ``ratio_bias`` says over what
the shift ``Δμ²`` is averaged: the chunk's samples with a non-zero advantage and their elements (``batch``) or
each sample's own elements (``sample``, ``r̃ = exp(mean_D(ξ·Δμ))``).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch
from pydantic import model_validator

from flowalign.config import Section
from flowalign.errors import UserError
from flowalign.sampling import Rollout, StepOutput
from flowalign.trainers.base import Sampling
from flowalign.trainers.parts.reductions import masked_mean


class RatioNormOptions(Section):
    """The normalised ratio and the per-step reweighting (each trainer states its defaults)."""

    #: r̃ = exp((ℓ_θ − ℓ_old + mean(Δμ²)/(2τ²))·τ) instead of exp(ℓ_θ − ℓ_old)
    ratio_norm: bool = True
    #: the mean of Δμ² in r̃: over the chunk's samples and elements ("batch") or each sample's ("sample")
    ratio_bias: Literal["batch", "sample"] = "batch"
    #: each step's surrogate divided by its σ gap h = σ_k − σ_{k+1}
    reweight: bool = True

    @model_validator(mode="after")
    def _gaussian_sampler(self):
        if self.ratio_norm and getattr(self, "sampler", "flow_grpo") == "cps":
            raise ValueError("trainer.ratio_norm reads a Gaussian step's mean and std, which trainer.sampler=cps's "
                             "coded log-probability is not: use trainer.sampler: flow_grpo or dance, or ratio_norm: "
                             "false")
        return self


def guard_ratio(log_prob: torch.Tensor, old_log_prob: torch.Tensor, mean: torch.Tensor, old_mean: torch.Tensor,
                std: torch.Tensor, bias_over: Literal["batch", "sample"] = "batch",
                active: torch.Tensor | None = None) -> torch.Tensor:
    """The normalised ratio ``(B,)``: ``exp((ℓ_θ − ℓ_old + mean(μ_θ − μ_old)²/(2τ²))·τ)``, with ``ℓ`` the
    per-element mean Gaussian log-densities ``(B,)``, ``μ`` ``(B, ...)`` and ``τ`` ``(B,)`` (equal across the
    batch, one step). The mean of the shift runs over every sample and element (``"batch"``; over the ``active``
    samples ``(B,)`` bool when any, as GRPO-Guard's authors drop samples with a zero advantage before batching) or
    over each sample's elements (``"sample"``)."""
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


class RatioNorm:
    """Trainer hooks: mixed in before ``FlowGRPOTrainer``, whose config then carries :class:`RatioNormOptions`."""

    @classmethod
    def keeps_velocities(cls, tcfg) -> bool:
        return tcfg.ratio_norm  # the normalised ratio reads the rollout's velocities

    def sampling(self, group: int) -> Sampling:
        """The trainer's sampling, keeping each step's velocity (the old policy's step mean ``μ_old``)."""
        return dataclasses.replace(super().sampling(group), keep_velocities=self.tcfg.ratio_norm)  # type: ignore[misc]

    def surrogate(self, chunk: Rollout, k: int, out: StepOutput, old_log_prob: torch.Tensor, adv: torch.Tensor,
                  weight: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The per-sample clipped surrogate of step ``k`` ``(B,)`` with the normalised ratio and the 1/h weight
        where set, the ratio and the clipped flag."""
        if self.tcfg.ratio_norm:
            if chunk.velocities is None:
                raise UserError("trainer.ratio_norm needs the rollouts' velocities, which these rollouts did not keep")
            with torch.no_grad():
                old = self.step_distribution(chunk, k, chunk.velocities[:, k].to(out.mean))  # type: ignore[attr-defined]
            std = out.std.flatten(1)[:, 0].expand(len(adv))
            ratio = guard_ratio(out.log_prob, old_log_prob, out.mean, old.mean, std, self.tcfg.ratio_bias,
                                active=adv != 0)
        else:
            ratio = torch.exp(out.log_prob - old_log_prob)
        gap = chunk.sigmas[k].item() - chunk.sigmas[k + 1].item()
        per_sample, clipped = guard_clip_loss(ratio, adv, self.tcfg.clip_range,  # type: ignore[attr-defined]
                                              1.0 / gap if self.tcfg.reweight else 1.0, weight)
        return per_sample, ratio, clipped
