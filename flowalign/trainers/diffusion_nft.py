"""DiffusionNFT (arXiv 2509.16117): the baseline DiffusionOPSD is measured against
(``docs/methods/diffusion_opsd.md``, "DiffusionNFT").

Same behaviour policy φ, ODE rollouts, mirrored velocities ``v±``, reward weight ``r`` and soft refresh
as OPSD (all from ``self_distill.py``); what differs is the training signal: each rollout
endpoint ``x_i`` is forward-noised, ``x_t = (1−t)·x_i + t·ε``, at the sampler's timesteps, and

    L = E[ r·mean(v⁺ − v)² + (1−r)·mean(v⁻ − v)² ],   v = ε − x_i,

so no reward gradient is needed: any reward (the verifier itself) works.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from flowalign.limits import MAX_GUIDANCE, MAX_SAMPLING_STEPS
from flowalign.sampling import Rollout
from flowalign.trainers.self_distill import (
    FitUnit,
    SelfDistillConfig,
    SelfDistillTrainer,
    mirrored_velocities,
    per_sample_mean,
)


class DiffusionNFTConfig(SelfDistillConfig):
    name: Literal["diffusion_nft"] = "diffusion_nft"
    #: noised copies of each endpoint per update, at distinct sampler timesteps σ_0..σ_{T-1} drawn per
    #: chunk (0: every timestep of the grid, the paper's "~all sampler timesteps")
    timesteps_per_sample: int = Field(0, ge=0, le=MAX_SAMPLING_STEPS)
    #: 1.0 here: the conditional velocity is the quantity whose flow-matching target ``ε − x_i`` is (the
    #: paper's CFG-free training); None fits the guided velocity, which wrecked the tiny model
    #: (docs/results.md)
    fit_guidance: float | None = Field(1.0, ge=1.0, le=MAX_GUIDANCE)


def nft_loss(
    v_theta: torch.Tensor, v_phi: torch.Tensor, target: torch.Tensor, r: torch.Tensor, beta: float
) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-sample NFT loss ``(B,)``: ``r·mean(v⁺ − v)² + (1−r)·mean(v⁻ − v)²``, ``target`` = ``v = ε − x_i``."""
    v_pos, v_neg = mirrored_velocities(v_theta, v_phi.detach(), beta)
    pos = per_sample_mean((v_pos - target) ** 2)
    neg = per_sample_mean((v_neg - target) ** 2)
    return r * pos + (1 - r) * neg, {"loss_pos": pos.mean().item(), "loss_neg": neg.mean().item()}


class DiffusionNFTTrainer(SelfDistillTrainer):
    Config = DiffusionNFTConfig
    tcfg: DiffusionNFTConfig

    def fit_units(self, chunk: Rollout, r: torch.Tensor, keep: torch.Tensor, generator: torch.Generator) -> list[FitUnit]:
        """One unit per chosen timestep: the noised endpoints and ``v_φ`` there (the caller swapped φ in)."""
        x0 = chunk.final_latents.to(self.policy.device)
        sigmas = chunk.sigmas[:-1]  # σ = 0 is the clean sample: nothing to learn there
        n = self.tcfg.timesteps_per_sample
        picked = (torch.randperm(len(sigmas), generator=generator)[:n].sort().values if 0 < n < len(sigmas)
                  else torch.arange(len(sigmas)))
        guidance = self.fit_guidance(chunk)
        units = []
        for k in picked.tolist():
            t = sigmas[k].item()
            eps = torch.randn(x0.shape, generator=generator).to(x0)
            x_t = (1 - t) * x0 + t * eps
            with torch.no_grad():
                v_phi = self.policy.velocity(x_t, t, chunk.cond, guidance)
            units.append(FitUnit(chunk, r.to(x0.device), keep, {"t": t, "x_t": x_t, "v_phi": v_phi, "target": eps - x0}))
        return units

    def fit_loss(self, unit: FitUnit) -> tuple[torch.Tensor, dict[str, float]]:
        x = unit.tensors
        v_theta = self.policy.velocity(x["x_t"], x["t"], unit.chunk.cond, self.fit_guidance(unit.chunk))
        return nft_loss(v_theta, x["v_phi"], x["target"], unit.r, self.tcfg.mirror_beta)
