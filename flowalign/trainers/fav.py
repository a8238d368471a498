"""FAV (*Few-step Generative Models Alignment via Sample-based Variational Inference*; ``docs/methods/fav.md``).

Alignment as sampling from the reward-tilted distribution ``p*(x) ∝ p_ref(x)·exp(β·r(x))`` (β:
``trainer.tilt``), with nothing but samples of the generator and of the reference. Per prompt, ``K``
generator particles ``x_i`` and ``K`` reference particles ``y_j`` (the few-step sampler's outputs, in the
space ``trainer.particles`` names: the reward's own image embedding where the run's one reward scores one,
as the authors' CLIP-feature rewards, else the final latents scaled to unit per-element RMS,
``x = z.flatten()/√D``):

    s(x)   = ∇_x log Σ_t Σ_j exp(−‖x − y_j‖²/t) + β·∇_x r(x)                  (KDE prior score + reward)
    φ(x_i) = (1/K) Σ_j [k(x_j, x_i)·s(x_j) + ρ·∇_{x_j} k(x_j, x_i)],  k = Σ_t exp(−‖·‖²/t)     (SVGD)
    L      = mean_i mean_D (x_i(θ) − sg(x_i + φ(x_i)))²                          (fixed-point regression)

``L``'s gradient is ``−(2/(K·D))·Σ_i φ(x_i)·∂x_i/∂θ``: the generator is moved along the SVGD direction,
so the particle update is amortised into the weights; no likelihood, no SDE, no particular solver is
needed. The generator here is the policy's few-step Euler ODE sampler (``num_steps``, 4 by default),
differentiated end to end; any generator ``noise ↦ sample`` fits the same three functions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from pydantic import Field
from torch.utils.checkpoint import checkpoint

from flowalign.config import Temperature
from flowalign.errors import UserError
from flowalign.limits import MAX_COEFFICIENT, MAX_GROUP_SIZE
from flowalign.protocols import Conditioning, FeatureReward
from flowalign.trainers.base import GroupTrainer, Plan, SliceUnit, derived_seed, slice_plan
from flowalign.trainers.copies import WeightCopy, full_reference
from flowalign.trainers.options import ReferenceOptions, RolloutOptions, TrainerConfig


class FAVConfig(TrainerConfig, RolloutOptions, ReferenceOptions):
    """The loop's rollout options (its own particles: no advantages)."""

    refused = {"beta": "FAV's reward tilt is now trainer.tilt (same meaning: p* ∝ p_ref·exp(tilt·r)); "
                       "flowalign's beta is always a KL weight"}

    name: Literal["fav"] = "fav"
    #: what runs saved before these options existed computed (see TrainerConfig.before)
    before = {"particles": "latents"}
    #: the few-step sampler the generator is (Euler ODE steps on the policy's sigma grid)
    num_steps: int = Field(4, ge=1, le=16)
    #: K generator particles per prompt (as many reference particles are drawn beside them)
    group_size: int = Field(8, ge=2, le=MAX_GROUP_SIZE)
    #: β of the method, the reward's tilt of the target p* ∝ p_ref·exp(β·r) (0: the reward only logs)
    tilt: float = Field(1.0, ge=0, le=MAX_COEFFICIENT)
    #: temperatures t of the multi-scale KDE of the reference particles
    kde_temperatures: list[Temperature] = Field(default_factory=lambda: [0.5], min_length=1)
    #: temperatures t of the multi-scale Stein kernel
    stein_temperatures: list[Temperature] = Field(default_factory=lambda: [0.5], min_length=1)
    #: ρ, the weight of SVGD's repulsive term (0.5: the authors' loss, its kernel gradient over 2K; 1: standard SVGD)
    repulsion: float = Field(0.5, ge=0, le=MAX_COEFFICIENT)
    #: the particles' space: ``reward_features`` (the run's one reward's image embedding, e.g. CLIP's unit
    #: vectors: the authors' form for image rewards), ``latents`` (the final latents at unit RMS: theirs for
    #: rewards without one, such as JPEG size), ``auto`` (the first where the reward has one, else the second)
    particles: Literal["auto", "reward_features", "latents"] = "auto"
    #: checkpoint the VAE decoder in the reward gradient and, with reward features, in the loss (memory for compute)
    decoder_checkpointing: bool = True


# ---------------------------------------------------------------------------------------------- the math


def _kernel_logits(x: torch.Tensor, y: torch.Tensor, temperatures: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(T, N, M)`` logits ``−‖x_i − y_j‖²/t`` and the matching ``(T, 1, 1)`` temperatures."""
    t = torch.tensor(temperatures, dtype=x.dtype, device=x.device).view(-1, 1, 1)
    return -(torch.cdist(x, y) ** 2)[None] / t, t


def kde_score(x: torch.Tensor, ref: torch.Tensor, temperatures: list[float]) -> torch.Tensor:
    """``∇_x log Σ_t Σ_j exp(−‖x − y_j‖²/t)`` ``(N, D)`` for particles ``x (N, D)`` and reference ``ref (M, D)``:
    the score of the reference's multi-scale kernel density, ``Σ_{t,j} w_tj·2(y_j − x)/t`` with ``w`` the
    softmax of the logits over (t, j) (computed stably in log space)."""
    logits, t = _kernel_logits(x, ref, temperatures)
    w = torch.softmax(logits.permute(1, 0, 2).reshape(len(x), -1), dim=1).view(len(x), len(t), -1).permute(1, 0, 2)
    pull = torch.einsum("tnm,md->tnd", w / t, ref) - (w / t).sum(-1, keepdim=True) * x[None]
    return 2 * pull.sum(0)


def svgd_velocity(x: torch.Tensor, score: torch.Tensor, temperatures: list[float],
                  repulsion: float = 1.0) -> torch.Tensor:
    """SVGD's update direction ``φ (N, D)`` for particles ``x (N, D)`` with scores ``s(x) (N, D)``:
    ``φ(x_i) = (1/N) Σ_j [k(x_j, x_i)·s(x_j) + ρ·∇_{x_j} k(x_j, x_i)]``, ``k = Σ_t exp(−‖·‖²/t)``,
    ``∇_{x_j} k(x_j, x_i) = Σ_t k_t·2(x_i − x_j)/t``."""
    logits, t = _kernel_logits(x, x, temperatures)
    k_t = logits.exp()  # (T, N, N), symmetric
    drive = k_t.sum(0) @ score
    push = 2 * ((k_t / t).sum(-1, keepdim=True) * x[None] - torch.einsum("tij,jd->tid", k_t / t, x)).sum(0)
    return (drive + repulsion * push) / len(x)


def fixed_point_loss(x: torch.Tensor, velocity: torch.Tensor) -> torch.Tensor:
    """Per-particle ``mean_D (x − sg(x + φ))²`` ``(N,)``: its gradient moves ``x`` (and what made it) along φ."""
    return ((x - (x + velocity).detach()) ** 2).mean(1)


def particles(latents: torch.Tensor) -> torch.Tensor:
    """``(N, D)`` particles of latents ``(N, ...)``: flattened, scaled to unit per-element RMS (``/√D``), so
    squared distances are per-element means and kernel temperatures do not depend on the latent size."""
    flat = latents.flatten(1)
    return flat / math.sqrt(flat.shape[1])


def feature_reward_gradient(reward: FeatureReward, weight: float, features: torch.Tensor, prompts: list[str],
                            metadata: list[dict]) -> torch.Tensor:
    """``∇_f w·R(f)`` ``(N, D)`` of a reward read from embeddings ``features (N, D)`` (the authors'
    ``fav_total_score``: autograd of the summed reward at the detached particles)."""
    with torch.enable_grad():
        f = features.detach().requires_grad_(True)
        (grad,) = torch.autograd.grad((weight * reward.feature_scores(f, prompts, metadata)).sum(), f)
    return grad.detach()


def euler_sample(policy: Any, noise: torch.Tensor, sigmas: torch.Tensor, cond: Conditioning,
                 guidance: float) -> torch.Tensor:
    """The few-step generator: Euler ODE steps from ``noise (B, ...)`` along ``sigmas`` to final latents
    ``(B, ...)``, differentiable in the policy's weights when called with gradients on."""
    x = noise
    for k in range(len(sigmas) - 1):
        x = x + (sigmas[k + 1] - sigmas[k]).item() * policy.velocity(x, sigmas[k].item(), cond, guidance)
    return x


# ---------------------------------------------------------------------------------------------- hooks


@dataclass
class ParticleBatch:
    """This rank's generator particles of a step: their initial noise, conditioning, SVGD directions
    ``(N, D)`` (every group whole on this rank), prompts and metadata, and the step's logs."""

    noise: torch.Tensor
    cond: Conditioning
    velocity: torch.Tensor
    prompts: list[str] = field(default_factory=list)
    metadata: list[dict] = field(default_factory=list)
    logs: dict[str, float] = field(default_factory=dict)


class FAVTrainer(GroupTrainer):
    Config = FAVConfig
    tcfg: FAVConfig
    sampler = "ode"

    @classmethod
    def weight_copies(cls, cfg, tcfg) -> list[WeightCopy]:
        return full_reference(tcfg) if cfg.model.finetune == "full" else []  # the reference particles come from the starting weights

    def __init__(self, *args: Any, **kw: Any):
        super().__init__(*args, **kw)
        bad = self.non_differentiable_rewards() if self.tcfg.tilt > 0 else []
        if bad:
            from flowalign.plugins import differentiable_rewards as differentiable

            raise UserError(f"rewards: fav follows ∇r of its rewards but {', '.join(map(repr, bad))} is not "
                            f"differentiable; use one of {', '.join(differentiable())} (e.g. vvr_soft for VVR)")
        #: ``(weight, reward)`` whose image embedding the particles live in; None: the particles are latents
        self.embedding = None if self.tcfg.particles == "latents" else self.rewards.embedding_reward()
        if self.embedding is None and self.tcfg.particles == "reward_features":
            raise UserError(f"trainer.particles: reward_features needs one reward that scores an image embedding "
                            f"(clip_score, hps, pickscore, aesthetic); the run's rewards are "
                            f"{self.rewards.names or 'none'}; give one of those, or particles: latents")

    def guidance(self) -> float:
        g = self.tcfg.guidance_scale
        return float(self.policy.defaults.get("guidance_scale", 1.0) if g is None else g)

    def noise(self, step: int, groups: torch.Tensor, stream: int) -> torch.Tensor:
        """``(N, ...)`` initial noise, each sample's from a generator keyed by (step, group, member, stream)."""
        out, member = [], {}
        for g in groups.tolist():
            m = member[g] = member.get(g, -1) + 1
            out.append(self.policy.initial_noise(1, torch.Generator().manual_seed(
                derived_seed(self.cfg.run.seed, step, g, m, stream))))
        return torch.cat(out).to(self.policy.device)

    @torch.no_grad()
    def generate(self, noise: torch.Tensor, cond: Conditioning) -> torch.Tensor:
        """Final latents of the few-step generator, in batches of ``batch_size`` (no gradient)."""
        sigmas, b = self.policy.sigmas(self.tcfg.num_steps).float(), self.tcfg.batch_size
        return torch.cat([euler_sample(self.policy, noise[s:s + b], sigmas, cond[s:s + b], self.guidance())
                          for s in range(0, len(noise), b)])

    def collect(self, step: int) -> ParticleBatch:
        """Generator and reference particles per prompt, the rewards and their gradients at the generator's,
        and each particle's SVGD direction."""
        tc = self.tcfg
        prompts, metadata, groups = self.step_prompts(step)
        cond = self.policy.encode(prompts)
        noise = self.noise(step, groups, 71)
        gen = self.generate(noise, cond)
        with self.policy.adapter_disabled():
            ref = self.generate(self.noise(step, groups, 73), cond)
        with torch.no_grad():
            images = self.policy.decode(gen)
            scored = self.score(images, prompts, metadata, step=step)
        if self.embedding is None:
            grad = (self.reward_gradient(prompts, metadata, tc.decoder_checkpointing)(gen)
                    if tc.tilt > 0 else torch.zeros_like(gen))
            x, y = particles(gen).float(), particles(ref).float()
            reward_grad = grad.flatten(1).float() * math.sqrt(x.shape[1])  # ∇_x r for x = z/√D
        else:
            weight, reward = self.embedding
            with torch.no_grad():
                x = reward.features(images, prompts, metadata).float()
                y = reward.features(self.policy.decode(ref), prompts, metadata).float()
            reward_grad = (feature_reward_gradient(reward, weight, x, prompts, metadata) if tc.tilt > 0
                           else torch.zeros_like(x))
        velocity = torch.zeros_like(x)
        for g in dict.fromkeys(groups.tolist()):
            m = groups == g
            s = kde_score(x[m], y[m], tc.kde_temperatures) + tc.tilt * reward_grad[m]
            velocity[m] = svgd_velocity(x[m], s, tc.stein_temperatures, tc.repulsion)
        logs = {**scored.logs, "fav/velocity_norm": velocity.norm(dim=1).mean().item(),
                "fav/gen_ref_distance": (x - y).norm(dim=1).mean().item()}
        return ParticleBatch(noise, cond, velocity, prompts, metadata, logs)

    def plan(self, batch: ParticleBatch, generator: torch.Generator) -> Plan:
        """One optimiser step over every particle, in micro-batches of ``batch_size``."""
        return slice_plan(self, len(batch.noise))

    def loss(self, batch: ParticleBatch, unit: SliceUnit) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The fixed-point regression of a micro-batch: the particles regenerated with gradients (the same
        noise and weights, so the same values) pulled toward ``x + φ``; with reward features, through the
        decoder and the reward's image encoder (the authors' ``_reward_features`` with gradients)."""
        sigmas = self.policy.sigmas(self.tcfg.num_steps).float()
        z = euler_sample(self.policy, batch.noise[unit.index], sigmas, batch.cond[unit.index], self.guidance())
        if self.embedding is None:
            x = particles(z).float()
        else:
            images = (checkpoint(self.policy.decode, z, use_reentrant=False) if self.tcfg.decoder_checkpointing
                      else self.policy.decode(z))
            x = self.embedding[1].features(images, batch.prompts[unit.index], batch.metadata[unit.index]).float()
        per = fixed_point_loss(x, batch.velocity[unit.index].to(x))
        return per.sum() / unit.total, {"fav_loss": per.detach().mean()}
