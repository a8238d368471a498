"""Flow-GRPO (arXiv 2505.05470): GRPO on the per-step Gaussians of an SDE rollout.

Read against ``shared/specs/flow_grpo.md``. The loop (rollouts, rewards, advantages, accumulation) is the
shared one; this file holds the config and the loss:

    r = exp(ℓ_k(θ) − ℓ_k(θ_old))
    L = mean_{i,k} max(−A_i·r, −A_i·clip(r, 1−ε, 1+ε)) + β·KL(μ_θ ‖ μ_ref)
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from flowalign.errors import UserError
from flowalign.sampling import Rollout, sde_step
from flowalign.sampling.windows import random_window_start
from flowalign.trainers.base import GroupTrainer, GroupTrainerConfig


class FlowGRPOConfig(GroupTrainerConfig):
    name: Literal["flow_grpo"] = "flow_grpo"
    sampler: Literal["flow_grpo", "cps"] = "flow_grpo"
    #: a for the Flow-GRPO SDE (0.7 SD3.5, 0.9 FLUX), η for CPS (0.8)
    noise_level: float = Field(0.7, gt=0, le=2)
    cps_log_prob: Literal["code", "gaussian"] = "code"
    clip_range: float = Field(1e-4, gt=0)
    beta: float = Field(0.04, ge=0)
    kl_mode: Literal["code", "exact"] = "code"
    #: train the first ⌊fraction·T⌋ SDE steps of each rollout
    timestep_fraction: float = Field(0.99, gt=0, le=1)
    #: Flow-GRPO-Fast: SDE only on a random window of this width in steps [0, T/2) (0: every step)
    sde_window: int = Field(0, ge=0)
    #: train a random subset of this many of the trained steps per chunk and epoch (0: all of them)
    steps_per_chunk: int = Field(0, ge=0)


def ppo_clip_loss(
    log_prob: torch.Tensor, old_log_prob: torch.Tensor, adv: torch.Tensor, clip_range: float,
    weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample clipped surrogate ``max(−w·A·r, −w·A·clip(r))`` ``(B,)``, with the ratio and a clipped flag."""
    ratio = torch.exp(log_prob - old_log_prob)
    scaled = adv if weight is None else adv * weight
    unclipped = -scaled * ratio
    clipped = -scaled * torch.clamp(ratio, 1 - clip_range, 1 + clip_range)
    return torch.maximum(unclipped, clipped), ratio, (clipped > unclipped)


def gaussian_mean_kl(mean: torch.Tensor, ref_mean: torch.Tensor, std: torch.Tensor, sigma_gap: float,
                     mode: str) -> torch.Tensor:
    """KL between same-variance Gaussian steps ``(B,)``: exact ``Σ_D Δμ²/(2τ²)`` or the authors' coded
    ``mean_D Δμ²/(2s²)`` with ``s² = τ²/h`` (= (h/D)·exact)."""
    sq = ((mean - ref_mean) ** 2) / (2 * std**2)
    if mode == "exact":
        return sq.flatten(1).sum(1)
    return sq.flatten(1).mean(1) * sigma_gap


class FlowGRPOTrainer(GroupTrainer):
    Config = FlowGRPOConfig
    tcfg: FlowGRPOConfig

    @classmethod
    def check_config(cls, cfg, tcfg) -> None:
        if tcfg.beta > 0 and cfg.model.finetune == "full":
            raise UserError("trainer.beta > 0 needs reference passes with the adapter disabled, which full "
                            "fine-tuning has not got: set trainer.beta=0 or model.finetune=lora")

    @property
    def sampler(self) -> str:  # type: ignore[override]
        return self.tcfg.sampler

    @property
    def noise_level(self) -> float:  # type: ignore[override]
        return self.tcfg.noise_level

    def rollout_chunk(self, prompts, metadata, generator, **kw):
        """SDE rollouts; with ``sde_window`` each chunk draws its own Flow-GRPO-Fast window."""
        if self.tcfg.sde_window:
            start = random_window_start(self.tcfg.num_steps, self.tcfg.sde_window, generator)
            kw["sde_window"] = (start, self.tcfg.sde_window)
        return super().rollout_chunk(prompts, metadata, generator, cps_log_prob=self.tcfg.cps_log_prob, **kw)

    def loss_units(self, batch, chunk_ids, generator):
        """All trained steps of each chunk, or a random subset of ``steps_per_chunk`` of them."""
        units = []
        for i in chunk_ids:
            steps = self.trained_steps(batch.chunks[i])
            if 0 < self.tcfg.steps_per_chunk < len(steps):
                pick = torch.randperm(len(steps), generator=generator)[: self.tcfg.steps_per_chunk]
                steps = [steps[j] for j in sorted(pick.tolist())]
            units += [(i, k) for k in steps]
        return units

    def trained_steps(self, chunk: Rollout) -> list[int]:
        steps = chunk.trained_steps()
        return steps[: max(1, int(self.tcfg.timestep_fraction * len(steps)))]

    def step_distribution(self, chunk: Rollout, k: int, velocity: torch.Tensor):
        x_k, x_next, _ = chunk.step(k)
        return sde_step(self.sampler, velocity, x_k, chunk.sigmas[k].item(), chunk.sigmas[k + 1].item(),
                        noise_level=self.noise_level, prev_sample=x_next, cps_log_prob=self.tcfg.cps_log_prob)

    def loss(self, chunk: Rollout, k: int, adv: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        x_k, _, old_log_prob = chunk.step(k)
        sigma = chunk.sigmas[k].item()
        v = self.policy.velocity(x_k, sigma, chunk.cond, chunk.guidance_scale)
        out = self.step_distribution(chunk, k, v)
        weight = chunk.extras.get("weight")  # per-sample loss weights (Flash-GRPO's rectification)
        per_sample, ratio, clipped = ppo_clip_loss(out.log_prob, old_log_prob.to(out.log_prob), adv.to(out.log_prob),
                                                   self.tcfg.clip_range, weight)
        active = adv != 0  # samples with zero advantage are dropped from the mean
        loss = per_sample[active].mean()
        info = {"ratio": ratio.mean().item(), "clip_frac": clipped[active].float().mean().item(),
                "policy_loss": loss.item()}
        if self.tcfg.beta > 0:
            with torch.no_grad(), self.policy.adapter_disabled():
                ref = self.step_distribution(chunk, k, self.policy.velocity(x_k, sigma, chunk.cond, chunk.guidance_scale))
            gap = chunk.sigmas[k].item() - chunk.sigmas[k + 1].item()
            kl = gaussian_mean_kl(out.mean, ref.mean, out.std, gap, self.tcfg.kl_mode)[active].mean()
            loss = loss + self.tcfg.beta * kl
            info["kl"] = kl.item()
        return loss, info
