"""Flash-GRPO (arXiv 2605.15980): iso-temporal single-step GRPO with temporal gradient rectification.

Read against ``shared/specs/flow_grpo.md``. Per unique prompt one step ``k_c ~ U{0 … T/2−1}`` is drawn
once and shared by the whole group; each member runs the ODE from its own noise except ONE SDE step at
``k_c`` (noise ``s_k = σ_1·σ_k`` in the Flow-GRPO mean, as the authors coded it), and only that step is
trained. Because ``∂ℓ/∂v = −ξ·c_k`` with ``c_k = |γ_k|/τ_k`` for a Gaussian step ``μ = αx + γv``, steps
far apart in σ get very different gradient scales; each sample's loss is weighted by
``ω_i = (1/c_{k_i}) / mean_all(1/c_k)`` so the per-timestep gradient norms are flat across k.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from pydantic import Field

from flowalign.sampling import StepOutput, flow_sde_step
from flowalign.trainers.base import StepBatch, derived_seed
from flowalign.trainers.flow_grpo import FlowGRPOConfig, FlowGRPOTrainer


class FlashGRPOConfig(FlowGRPOConfig):
    name: Literal["flash_grpo"] = "flash_grpo"  # type: ignore[assignment]
    num_steps: int = Field(20, ge=4)
    clip_range: float = Field(1e-3, gt=0)
    beta: float = Field(0.0, ge=0)
    #: iso-temporal steps are drawn from {0 … ⌊T·max_step_fraction⌋ − 1}
    max_step_fraction: float = Field(0.5, gt=0, le=1)
    rectify: bool = True


def flash_diffusion(sigmas: torch.Tensor, k: int) -> float:
    """The authors' SDE noise ``s_k = σ_1·σ_k`` on the scheduler grid ``sigmas`` ``(T+1,)``."""
    return float(sigmas[1] * sigmas[k])


def rectification_coefficient(sigmas: torch.Tensor, k: int) -> float:
    """``c_k = |γ_k| / τ_k`` of the Flow-GRPO-form step at ``k`` [derived]:
    ``γ = (1 + s²(1−σ)/(2σ))·Δ``, ``τ = s·sqrt(h)``, i.e. ``sqrt(h)/s + s·sqrt(h)(1−σ)/(2σ)``."""
    sigma, sigma_next = float(sigmas[k]), float(sigmas[k + 1])
    h = sigma - sigma_next
    s = flash_diffusion(sigmas, k)
    gamma = (1 + s**2 * (1 - sigma) / (2 * sigma)) * h
    return abs(gamma) / (s * math.sqrt(h))


class FlashGRPOTrainer(FlowGRPOTrainer):
    Config = FlashGRPOConfig
    tcfg: FlashGRPOConfig

    def step_fn(self, sigmas: torch.Tensor, k: int):
        s = flash_diffusion(sigmas, k)

        def flash_sde(v, x, sigma, sigma_next, generator, prev_sample) -> StepOutput:
            return flow_sde_step(v, x, sigma, sigma_next, diffusion=s, generator=generator, prev_sample=prev_sample)

        return flash_sde

    def iso_temporal_step(self, group_id: int) -> int:
        """``k_c`` of a prompt group, seeded by (run seed, step, group id): every rank computes the same
        value, so no broadcast is needed."""
        g = torch.Generator().manual_seed(derived_seed(self.cfg.run.seed, self.step, group_id, 7))
        high = max(1, int(self.tcfg.num_steps * self.tcfg.max_step_fraction))
        return int(torch.randint(0, high, (1,), generator=g))

    def sample(self, prompts, metadata, groups) -> StepBatch:
        batch = super().sample(prompts, metadata, groups)
        self._set_rectification_weights(batch.chunks)
        return batch

    def sample_group(self, gid, prompts, metadata, generator):
        """The whole group shares ``k_c``: ODE everywhere except one SDE step there."""
        sigmas = self.policy.sigmas(self.tcfg.num_steps).float().cpu()
        k = self.iso_temporal_step(gid)
        chunks = super().sample_group(gid, prompts, metadata, generator, sampler=self.step_fn(sigmas, k), sde_window=(k, 1))
        for chunk in chunks:
            chunk.extras["k"] = k
            chunk.extras["inv_c"] = torch.full((len(chunk),), 1.0 / rectification_coefficient(sigmas, k))
        return chunks

    def _set_rectification_weights(self, chunks) -> None:
        """``ω_i = (1/c_{k_i}) / mean over all ranks' samples of 1/c_k`` (so mean ω = 1)."""
        inv_c = torch.cat([c.extras["inv_c"] for c in chunks])
        mean_inv_c = self.acc.gather(inv_c.to(self.acc.device)).float().mean().cpu()
        for c in chunks:
            c.extras["weight"] = c.extras["inv_c"] / mean_inv_c if self.tcfg.rectify else torch.ones_like(c.extras["inv_c"])

    def trained_steps(self, chunk) -> list[int]:
        return [chunk.extras["k"]]

    def step_distribution(self, chunk, k, velocity):
        x_k, x_next, _ = chunk.step(k)
        return self.step_fn(chunk.sigmas, k)(velocity, x_k, chunk.sigmas[k].item(), chunk.sigmas[k + 1].item(),
                                             None, x_next)
