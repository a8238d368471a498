"""DiffusionOPSD: on-policy self-distillation toward reward-gradient targets (``shared/specs/diffusion_opsd.md``).

One outer iteration [code]:

1. ODE rollouts with the behaviour weights φ (no grad); keep the query state ``z_q`` at
   ``k_q = argmin_{k≥1} |σ_k − σ*|``.
2. ``A_i = (R_i − mean_group R) / (std_batch R + 1e-4)`` (``advantage: global_std``).
3. Anchor ``y0 = z_q − σ_q·v_φ(z_q)``.
4. Bounded targets ``y±``: ``n`` normalised steps of ``±∇_y R(D(y), c)`` of size ``η·ρ‖y0‖/n``, each
   projected onto the ball of radius ``ρ‖y0‖`` around ``y0`` (gradients through the VAE decoder, with
   gradient checkpointing there).
5. ``v± `` mirrored around ``v_φ``; ``ŷ± = z_q − σ_q·v±``; the fitting loss
   ``L = A_max·mean_i[r_i·mean(ŷ⁺−y⁺)²/w⁺ + (1−r_i)·mean(ŷ⁻−y⁻)²/w⁻]``.
6. K optimiser updates on these fixed targets ("finite fitting").
7. Behaviour refresh ``φ ← λ_s·φ + (1−λ_s)·θ``, ``λ_s = min(0.001·s, 0.5)``.

[derived] choices: ``k_q`` also stays below ``T`` (σ = 0 has nothing to denoise); samples with an invalid
reward are left out of the fit rather than trained at r = ½; the refresh runs once per outer iteration
after its K updates, with s counting optimiser steps; the spec's β is the config field ``mirror_beta``.
``trainer.fit_guidance`` (default null: the spec's "same CFG as the rollout") optionally reads every
velocity of steps 3-5 at another CFG scale, 1.0 being the conditional velocity alone (NFT's default).

The pieces DiffusionNFT shares (config, behaviour weights, mirrored velocities, ``r``, the fitting loop
and refresh, checkpoints holding φ) live here in :class:`SelfDistillTrainer`; ``diffusion_nft.py``
overrides only what a training unit is and its loss.
"""

from __future__ import annotations

import time
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
from pydantic import Field
from torch.utils.checkpoint import checkpoint

from flowalign.checkpoint import TRAINER_STATE_PREFIX
from flowalign.errors import UserError
from flowalign.sampling import Rollout
from flowalign.trainers.base import GroupTrainer, GroupTrainerConfig, StepBatch
from flowalign.weight_swap import swapped_in


class SelfDistillConfig(GroupTrainerConfig):
    """Options DiffusionOPSD and DiffusionNFT share ([code] defaults; scale the group down on tiny models)."""

    lr: float = Field(3e-4, gt=0)
    group_size: int = Field(24, ge=2)
    advantage: str = Field("global_std", pattern="^(group|global_std|gdpo|win_rate)$")
    #: A_max: advantages are clipped to ±A_max and mapped to r = A/(2·A_max) + 1/2
    adv_clip: float = Field(5.0, gt=0)
    #: the spec's β of the mirrored velocities v± (0.1 for a 3-reward mix); not named ``beta``, which
    #: flowalign reads as a KL-to-reference weight (refused with full fine-tuning)
    mirror_beta: float = Field(1.0, gt=0)
    #: K optimiser updates per outer iteration on its fixed targets
    fit_steps: int = Field(1, ge=1)
    #: λ_s = min(behaviour_rate·s, behaviour_max), s = optimiser steps so far
    behaviour_rate: float = Field(0.001, ge=0)
    behaviour_max: float = Field(0.5, ge=0, le=1)
    #: the separate EMA of θ used for evaluation and checkpoints
    ema_decay: float = Field(0.9, ge=0, lt=1)
    ema_every: int = Field(1, ge=1)
    #: CFG scale of every velocity the fit reads (v_θ, v_φ and, for OPSD, the anchor's). None: the
    #: rollout's scale (OPSD's spec: "same CFG as the rollout"); 1.0: the conditional velocity alone, so the
    #: unconditional branch is not pushed through the CFG formula (NFT's default; docs/opsd_nft.md,
    #: session 11). Rollouts keep their CFG either way.
    fit_guidance: float | None = Field(None, ge=1.0)


class DiffusionOPSDConfig(SelfDistillConfig):
    name: Literal["diffusion_opsd"] = "diffusion_opsd"
    #: σ* of the query state (0.278 SD3.5-M; 0.273 for a step-distilled model)
    sigma_star: float = Field(0.278, gt=0, lt=1)
    #: ρ: target budget b = ρ‖y0‖
    rho: float = Field(0.10, gt=0)
    #: n ascent steps per direction, each of size h = η·b/n
    ascent_steps: int = Field(2, ge=1)
    eta: float = Field(1.0, gt=0)
    #: recompute the VAE decoder's activations in the backward pass instead of storing them
    decoder_checkpointing: bool = True


# ---------------------------------------------------------------------------------------------- pieces


class BehaviourWeights:
    """φ: a second set of the trainable tensors (the LoRA adapter, or the full weights of a tiny model),
    swapped into the live parameters when the behaviour policy runs — no second model copy."""

    def __init__(self, params: list[torch.nn.Parameter]):
        self.params = list(params)
        self.tensors = [p.detach().clone() for p in self.params]

    def swapped_in(self) -> AbstractContextManager[None]:
        """The live parameters hold φ inside (θ is restored after, even on error)."""
        return swapped_in(self.params, self.tensors)

    @torch.no_grad()
    def refresh(self, lam: float) -> None:
        """``φ ← λ·φ + (1−λ)·θ`` (λ = 0 copies θ exactly)."""
        for phi, p in zip(self.tensors, self.params):
            if lam == 0:
                phi.copy_(p.detach())
            else:
                phi.mul_(lam).add_(p.detach(), alpha=1 - lam)


def behaviour_lambda(step: int, rate: float, cap: float) -> float:
    """``λ_s = min(rate·s, cap)`` [code]."""
    return min(rate * step, cap)


def reward_weight(adv: torch.Tensor, a_max: float) -> torch.Tensor:
    """``r = clip(clip(A, −A_max, A_max)/(2·A_max) + 1/2, 0, 1)`` ``(B,)``."""
    return (adv.clamp(-a_max, a_max) / (2 * a_max) + 0.5).clamp(0, 1)


def mirrored_velocities(v_theta: torch.Tensor, v_phi: torch.Tensor, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``v⁺ = β·v_θ + (1−β)·v_φ`` and ``v⁻ = (1+β)·v_φ − β·v_θ`` (``v_φ`` detached by the caller)."""
    return beta * v_theta + (1 - beta) * v_phi, (1 + beta) * v_phi - beta * v_theta


def per_sample_mean(x: torch.Tensor) -> torch.Tensor:
    """``mean(·)`` over the non-batch elements: ``(B, ...)`` → ``(B,)``."""
    return x.flatten(1).mean(1)


def query_index(sigmas: torch.Tensor, sigma_star: float) -> int:
    """``k_q = argmin_k |σ_k − σ*|`` over ``1 ≤ k ≤ T−1`` (a state strictly between noise and sample)."""
    inner = sigmas[1:-1] if len(sigmas) > 2 else sigmas[1:]
    return 1 + int(torch.argmin((inner - sigma_star).abs()))


def bounded_targets(
    y0: torch.Tensor, grad_fn, rho: float, n: int, eta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y⁺, y⁻)`` detached, each ``(B, ...)``: ``n`` normalised reward-gradient steps from ``y0`` in each
    direction, projected onto the ball ``‖y − y0‖ ≤ b = ρ‖y0‖`` (per sample), step ``h = η·b/n``.

    ``grad_fn(y) -> ∇_y R`` (same shape); the first gradient, at ``y0``, is shared by both directions.
    """
    y0 = y0.detach()
    shape = (-1,) + (1,) * (y0.ndim - 1)
    budget = rho * y0.flatten(1).norm(dim=1).view(shape)
    h = eta * budget / n
    g0 = grad_fn(y0)
    out = []
    for d in (1.0, -1.0):
        y = y0
        for i in range(n):
            g = g0 if i == 0 else grad_fn(y)
            y = y + d * h * g / (g.flatten(1).norm(dim=1).view(shape) + 1e-12)
            off = y - y0
            scale = (budget / off.flatten(1).norm(dim=1).view(shape).clamp(min=1e-30)).clamp(max=1.0)
            y = y0 + off * scale
        out.append(y.detach())
    return out[0], out[1]


@torch.no_grad()
def query_anchor(policy, chunk: Rollout, sigma_star: float, guidance: float | None = None
                 ) -> tuple[float, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(σ_q, z_q, v(z_q), y0 = z_q − σ_q·v(z_q))`` of a rollout at its query state (``z_q``, ``v``, ``y0``:
    ``(B, ...)``); the velocity is the live weights' (the trainer swaps φ in first), at CFG ``guidance``
    (None: the rollout's)."""
    k = query_index(chunk.sigmas, sigma_star)
    sigma_q = chunk.sigmas[k].item()
    z_q = chunk.latents[:, k].to(policy.device)
    v = policy.velocity(z_q, sigma_q, chunk.cond, chunk.guidance_scale if guidance is None else guidance)
    return sigma_q, z_q, v, z_q - sigma_q * v


def pixel_reward_gradient(policy, rewards, prompts: list[str], metadata: list[dict], checkpointing: bool = True):
    """``y ↦ ∇_y Σ_j w_j R_j(D(y), c)`` ``(B, ...)``: through the VAE decoder (checkpointed), never θ.

    ``rewards`` is a list of ``(name, weight, reward)``; invalid samples contribute no gradient.
    """

    def grad_fn(y: torch.Tensor) -> torch.Tensor:
        with torch.enable_grad():
            y = y.detach().requires_grad_(True)
            images = checkpoint(policy.decode, y, use_reentrant=False) if checkpointing else policy.decode(y)
            total = torch.zeros(len(prompts), device=images.device)
            for _, weight, reward in rewards:
                out = reward(images, prompts, metadata)
                total = total + weight * torch.where(out.valid.to(images.device), out.total.to(images.device), 0.0)
            if not total.requires_grad:  # e.g. a batch of counts under vvr_soft(count_gradients=False)
                return torch.zeros_like(y)
            (g,) = torch.autograd.grad(total.sum(), y, allow_unused=True)
        return torch.zeros_like(y) if g is None else g.detach()

    return grad_fn


def opsd_loss(
    v_theta: torch.Tensor, v_phi: torch.Tensor, z_q: torch.Tensor, sigma_q: float, y_pos: torch.Tensor,
    y_neg: torch.Tensor, r: torch.Tensor, beta: float, a_max: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-sample OPSD fitting loss ``(B,)``: ``A_max·[r·mean(ŷ⁺−y⁺)²/w⁺ + (1−r)·mean(ŷ⁻−y⁻)²/w⁻]``.

    ``w± = sg(max(mean|ŷ± − y±|, 1e-5))``; ``v_phi``, ``z_q``, ``y±``, ``r`` are constants.
    """
    v_pos, v_neg = mirrored_velocities(v_theta, v_phi.detach(), beta)
    y_hat_pos, y_hat_neg = z_q - sigma_q * v_pos, z_q - sigma_q * v_neg
    w_pos = per_sample_mean((y_hat_pos - y_pos).abs()).clamp(min=1e-5).detach()
    w_neg = per_sample_mean((y_hat_neg - y_neg).abs()).clamp(min=1e-5).detach()
    pos = per_sample_mean((y_hat_pos - y_pos) ** 2) / w_pos
    neg = per_sample_mean((y_hat_neg - y_neg) ** 2) / w_neg
    loss = a_max * (r * pos + (1 - r) * neg)
    return loss, {"loss_pos": pos.mean().item(), "loss_neg": neg.mean().item()}


@dataclass
class FitUnit:
    """What one θ-phase backward pass needs, computed once per outer iteration under φ (all detached)."""

    chunk: Rollout
    r: torch.Tensor  # (B,)
    keep: torch.Tensor  # (B,) bool: samples with a valid reward
    tensors: dict[str, Any]


# ---------------------------------------------------------------------------------------------- loop


class SelfDistillTrainer(GroupTrainer):
    """The loop OPSD and NFT share: φ-rollouts, targets under φ, K fitting updates, behaviour refresh.

    Subclasses define :meth:`prepare` (φ phase of one chunk, no parameter gradient → fit units) and
    :meth:`fit_loss` (θ phase of one unit: per-sample loss ``(B,)``, one backward pass each).
    """

    Config = SelfDistillConfig
    tcfg: SelfDistillConfig
    sampler = "ode"

    def __init__(self, *args: Any, **kw: Any):
        super().__init__(*args, **kw)
        self.check_rewards()
        self.behaviour = BehaviourWeights(self.params)
        self.optimizer_steps = 0
        self._steps_buf = torch.zeros(1, dtype=torch.float64)  # optimizer_steps as a checkpointable tensor
        self._valid: torch.Tensor | None = None

    def check_rewards(self) -> None:
        """Refuse rewards the method cannot use, before any compute is spent (NFT takes any)."""

    def train_step(self) -> dict[str, float]:
        """The shared step, also logging this process's CPU time (``time/cpu_minutes``, cumulative over
        training steps since start or resume): on a shared machine wall-clock time depends on the
        neighbours, CPU time much less, so methods are compared on both."""
        start = time.process_time()
        logs = super().train_step()
        self.train_cpu_seconds = getattr(self, "train_cpu_seconds", 0.0) + time.process_time() - start
        logs["time/cpu_minutes"] = self.train_cpu_seconds / 60
        return logs

    # ------------------------------------------------------------ phases of the shared loop
    def sample(self, prompts: list[str], metadata: list[dict], groups: torch.Tensor) -> StepBatch:
        """Grouped ODE rollouts with the behaviour weights φ."""
        with self.behaviour.swapped_in():
            return super().sample(prompts, metadata, groups)

    def advantages(self, components: torch.Tensor, valid: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
        self._valid = valid  # samples with invalid rewards are left out of the fit (not trained at r=½)
        return super().advantages(components, valid, groups)

    def update(self, batch: StepBatch, adv: torch.Tensor, generator: torch.Generator) -> dict[str, float]:
        """Targets under φ once, then K optimiser steps fitting them, then ``φ ← λφ + (1−λ)θ``."""
        sizes = [len(c) for c in batch.chunks]
        valid = self._valid if self._valid is not None else torch.ones(sum(sizes), dtype=torch.bool)
        r_all = reward_weight(adv.float(), self.tcfg.adv_clip)
        with self.behaviour.swapped_in():
            units = [u for c, r, ok in zip(batch.chunks, torch.split(r_all, sizes), torch.split(valid, sizes))
                     for u in self.prepare(c, r, ok, generator)]
        units = [u for u in units if u.keep.any()]
        stats: dict[str, list[float]] = {}
        total = sum(int(u.keep.sum()) for u in units)
        for _ in range(self.tcfg.fit_steps):  # every rank steps, even one whose samples were all invalid
            for u in units:
                per_sample, info = self.fit_loss(u)
                (per_sample[u.keep].sum() / total).backward()  # the mean over kept (sample, unit) pairs
                for key, value in info.items():
                    stats.setdefault(key, []).append(value)
                stats.setdefault("loss", []).append(per_sample[u.keep].mean().item())
            stats.setdefault("grad_norm", []).append(self.optimizer_step())
            self.optimizer_steps += 1
        lam = behaviour_lambda(self.optimizer_steps, self.tcfg.behaviour_rate, self.tcfg.behaviour_max)
        self.behaviour.refresh(lam)
        stats["behaviour_lambda"] = [lam]
        stats["r_mean"] = [r_all[valid].mean().item() if valid.any() else float("nan")]
        return {k: float(np.mean(v)) for k, v in stats.items()}

    def prepare(self, chunk: Rollout, r: torch.Tensor, keep: torch.Tensor, generator: torch.Generator) -> list[FitUnit]:
        """The fixed targets of one chunk under φ (one unit per backward pass)."""
        raise NotImplementedError

    def fit_loss(self, unit: FitUnit) -> tuple[torch.Tensor, dict[str, float]]:
        raise NotImplementedError

    def fit_guidance(self, chunk: Rollout) -> float:
        """The CFG scale of the velocities the fit reads (``trainer.fit_guidance``, else the rollout's)."""
        return chunk.guidance_scale if self.tcfg.fit_guidance is None else self.tcfg.fit_guidance

    # ------------------------------------------------------------ checkpoints hold φ too
    def trainable_state(self) -> dict[str, torch.Tensor]:
        """θ's tensors plus φ's (``behaviour.<name>``) and the optimiser-step count, so resume restores both."""
        live = super().trainable_state()
        names = list(live)
        state = dict(live)
        state.update({f"{TRAINER_STATE_PREFIX}{n}": t for n, t in zip(names, self.behaviour.tensors)})
        self._steps_buf.fill_(float(self.optimizer_steps))
        state[f"{TRAINER_STATE_PREFIX}optimizer_steps"] = self._steps_buf  # s of λ_s
        return state

    def maybe_resume(self) -> None:
        """The shared resume copies saved tensors into :meth:`trainable_state`'s, φ's and s's included."""
        self._steps_buf.fill_(-1.0)
        super().maybe_resume()
        if self._steps_buf.item() >= 0:
            self.optimizer_steps = int(self._steps_buf.item())


class DiffusionOPSDTrainer(SelfDistillTrainer):
    Config = DiffusionOPSDConfig
    tcfg: DiffusionOPSDConfig

    def check_rewards(self) -> None:
        """OPSD ascends ``∇_y R``: every reward must be differentiable (checked before any sampling)."""
        bad = [name for name, _, reward in self.rewards if not getattr(reward, "differentiable", False)]
        if bad:
            # lazily, on the error path only: the core meets rewards through the registry, never at import
            from flowalign.plugins import differentiable_rewards as differentiable

            ok = differentiable()
            raise UserError(
                f"rewards: diffusion_opsd needs differentiable rewards but {', '.join(map(repr, bad))} is not; "
                f"use one of {', '.join(ok)} (e.g. vvr_soft for VVR tasks), or trainer.name=diffusion_nft"
            )

    def reward_gradient(self, chunk: Rollout):
        """``y ↦ ∇_y Σ_j w_j R_j(D(y), c)`` for this chunk's prompts (see :func:`pixel_reward_gradient`)."""
        return pixel_reward_gradient(self.policy, self.rewards, chunk.prompts, chunk.metadata,
                                     self.tcfg.decoder_checkpointing)

    def prepare(self, chunk: Rollout, r: torch.Tensor, keep: torch.Tensor, generator: torch.Generator) -> list[FitUnit]:
        """Query state, anchor ``y0`` and targets ``y±`` under φ (the caller swapped φ in)."""
        t = self.tcfg
        sigma_q, z_q, v_phi, y0 = query_anchor(self.policy, chunk, t.sigma_star, self.fit_guidance(chunk))
        y_pos, y_neg = bounded_targets(y0, self.reward_gradient(chunk), t.rho, t.ascent_steps, t.eta)
        return [FitUnit(chunk, r.to(y0.device), keep,
                        {"z_q": z_q, "sigma_q": sigma_q, "v_phi": v_phi, "y0": y0, "y_pos": y_pos, "y_neg": y_neg})]

    def fit_loss(self, unit: FitUnit) -> tuple[torch.Tensor, dict[str, float]]:
        x = unit.tensors
        v_theta = self.policy.velocity(x["z_q"], x["sigma_q"], unit.chunk.cond, self.fit_guidance(unit.chunk))
        return opsd_loss(v_theta, x["v_phi"], x["z_q"], x["sigma_q"], x["y_pos"], x["y_neg"], unit.r,
                         self.tcfg.mirror_beta, self.tcfg.adv_clip)
