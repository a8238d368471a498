"""DiffusionOPSD: on-policy self-distillation toward reward-gradient targets (``docs/methods/diffusion_opsd.md``).

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
after its K updates, with s counting optimiser steps; the method page's β is the config field ``mirror_beta``.
``trainer.fit_guidance`` (default null: the method page's "same CFG as the rollout") optionally reads every
velocity of steps 3-5 at another CFG scale, 1.0 being the conditional velocity alone (NFT's default).

Steps 1, 2, 6 and 7 and the mirrored velocities are shared with DiffusionNFT (``self_distill.py``); this
file holds the config, the targets, the loss and the two hooks that define a fit unit and its loss.

Steps 1-7 compute what worldbench/DiffusionOPSD @ 4562f0f computes (``scripts/train_opsd_ri_sd3.py``, its OPA
path; known answers in ``tests/flowalign/trainers/known_answers/diffusion_opsd_*.json``). ``rollout_solver: dpm2``
samples the rollouts with their multistep DPM-Solver++(2) on the policy's grid (diffusers'
``DPMSolverMultistepScheduler``, equal to their ``run_sampling(solver="dpm2")``: known answers in
``tests/flowalign/sampling/known_answers/ode_solvers_dpm2.json``); ``euler`` (the default) is the Euler ODE.
``model_timestep: truncated`` (the default) gives the transformer their integer timestep at every call:
``trunc(1000·σ)`` of the float32 product in the rollouts (their ``pipeline_with_logprob``), ``int(1000·σ_q)`` in
double precision for the anchor and the fit (their OPA block); ``continuous`` keeps the pipeline's ``1000·σ``.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from flowalign.errors import UserError
from flowalign.limits import MAX_COEFFICIENT, MAX_UPDATES
from flowalign.sampling import Rollout
from flowalign.sampling.ode_solvers import OdeSolver
from flowalign.sampling.timesteps import fixed, integer_timestep, model_timestep
from flowalign.trainers.parts.reductions import per_sample_mean
from flowalign.trainers.self_distill import (
    FitUnit,
    SelfDistillConfig,
    SelfDistillTrainer,
    mirrored_velocities,
)


class DiffusionOPSDConfig(SelfDistillConfig):
    name: Literal["diffusion_opsd"] = "diffusion_opsd"
    #: σ* of the query state (0.278 SD3.5-M; 0.273 for a step-distilled model)
    sigma_star: float = Field(0.278, gt=0, lt=1)
    #: ρ: target budget b = ρ‖y0‖
    rho: float = Field(0.10, gt=0, le=MAX_COEFFICIENT)
    #: n ascent steps per direction, each of size h = η·b/n
    ascent_steps: int = Field(2, ge=1, le=MAX_UPDATES)
    eta: float = Field(1.0, gt=0, le=MAX_COEFFICIENT)
    #: recompute the VAE decoder's activations in the backward pass instead of storing them
    decoder_checkpointing: bool = True
    #: rollout ODE solver on the policy's grid: Euler, or the authors' multistep DPM-Solver++(2) (their SD3.5 runs)
    rollout_solver: Literal["euler", "dpm2"] = "euler"
    #: the transformer's timestep: their integer trunc(1000σ) ("truncated"), or the pipeline's 1000σ ("continuous")
    model_timestep: Literal["truncated", "continuous"] = "truncated"


# ---------------------------------------------------------------------------------------------- the loss


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
            # the authors' projection: scale min(b/(‖y − y0‖ + 1e-12), 1), so a zero step stays at y0
            scale = (budget / (off.flatten(1).norm(dim=1).view(shape) + 1e-12)).clamp(max=1.0)
            y = y0 + off * scale
        out.append(y.detach())
    return out[0], out[1]


def query_timestep(sigma_q: float, form: str):
    """The transformer's timestep at the query state: their ``int(1000·σ_q)`` (σ_q a Python float, the product
    in double precision, as their anchor and fit compute it) for ``"truncated"``; None (the pipeline's
    ``1000·σ_q``) for ``"continuous"``."""
    return fixed(integer_timestep(sigma_q)) if form == "truncated" else None


@torch.no_grad()
def query_anchor(policy, chunk: Rollout, sigma_star: float, guidance: float | None = None,
                 timestep: str = "continuous") -> tuple[float, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(σ_q, z_q, v(z_q), y0 = z_q − σ_q·v(z_q))`` of a rollout at its query state (``z_q``, ``v``, ``y0``:
    ``(B, ...)``); the velocity is the live weights' (the trainer swaps φ in first), at CFG ``guidance``
    (None: the rollout's), the transformer reading the ``timestep`` form (:func:`query_timestep`)."""
    k = query_index(chunk.sigmas, sigma_star)
    sigma_q = chunk.sigmas[k].item()
    z_q = chunk.latents[:, k].to(policy.device)
    with model_timestep(policy, query_timestep(sigma_q, timestep), sigma_q):
        v = policy.velocity(z_q, sigma_q, chunk.cond, chunk.guidance_scale if guidance is None else guidance)
    return sigma_q, z_q, v, z_q - sigma_q * v


def normalised_error(y_hat: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``mean((ŷ − y)²/w)`` ``(B,)`` with ``w = sg(max(mean|ŷ − y|, 1e-5))`` per sample, ``w`` in float64 as the
    authors compute it (``ŷ``, ``y``: ``(B, ...)``; the result is float64, its gradient reaches ``ŷ`` only)."""
    with torch.no_grad():
        w = per_sample_mean((y_hat.double() - y.double()).abs()).clamp(min=1e-5)
    return per_sample_mean((y_hat - y) ** 2 / w.view(-1, *([1] * (y.ndim - 1))))


def opsd_loss(
    v_theta: torch.Tensor, v_phi: torch.Tensor, z_q: torch.Tensor, sigma_q: float, y_pos: torch.Tensor,
    y_neg: torch.Tensor, r: torch.Tensor, beta: float, a_max: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-sample OPSD fitting loss ``(B,)``: ``A_max·[r·mean(ŷ⁺−y⁺)²/w⁺ + (1−r)·mean(ŷ⁻−y⁻)²/w⁻]``.

    ``w± = sg(max(mean|ŷ± − y±|, 1e-5))``; ``v_phi``, ``z_q``, ``y±``, ``r`` are constants.
    """
    v_pos, v_neg = mirrored_velocities(v_theta, v_phi.detach(), beta)
    y_hat_pos, y_hat_neg = z_q - sigma_q * v_pos, z_q - sigma_q * v_neg
    pos = normalised_error(y_hat_pos, y_pos)
    neg = normalised_error(y_hat_neg, y_neg)
    loss = a_max * (r * pos + (1 - r) * neg)
    return loss, {"loss_pos": pos.detach().mean(), "loss_neg": neg.detach().mean()}


# ---------------------------------------------------------------------------------------------- hooks


class DiffusionOPSDTrainer(SelfDistillTrainer):
    Config = DiffusionOPSDConfig
    tcfg: DiffusionOPSDConfig

    @property
    def sampler(self) -> OdeSolver:  # type: ignore[override]
        """The φ-rollouts' solver (``rollout_solver``) on the policy's own grid, with the ``model_timestep`` form."""
        return OdeSolver(self.tcfg.rollout_solver, timestep=self.tcfg.model_timestep)

    def check_rewards(self) -> None:
        """OPSD ascends ``∇_y R``: every reward must be differentiable (checked before any sampling)."""
        bad = self.non_differentiable_rewards()
        if bad:
            # lazily, on the error path only: the core meets rewards through the registry, never at import
            from flowalign.plugins import differentiable_rewards as differentiable

            ok = differentiable()
            raise UserError(
                f"rewards: diffusion_opsd needs differentiable rewards but {', '.join(map(repr, bad))} is not; "
                f"use one of {', '.join(ok)} (e.g. vvr_soft for VVR tasks), or trainer.name=diffusion_nft"
            )

    def fit_units(self, chunk: Rollout, r: torch.Tensor, keep: torch.Tensor, generator: torch.Generator) -> list[FitUnit]:
        """Query state, anchor ``y0`` and targets ``y±`` under φ (the caller swapped φ in)."""
        t = self.tcfg
        sigma_q, z_q, v_phi, y0 = query_anchor(self.policy, chunk, t.sigma_star, self.fit_guidance(chunk),
                                               t.model_timestep)
        # y ↦ ∇_y Σ_j w_j R_j(D(y), c) for this chunk's prompts, through the VAE decoder
        gradient = self.reward_gradient(chunk.prompts, chunk.metadata, t.decoder_checkpointing)
        y_pos, y_neg = bounded_targets(y0, gradient, t.rho, t.ascent_steps, t.eta)
        return [FitUnit(chunk, r.to(y0.device, non_blocking=True), keep,
                        {"z_q": z_q, "sigma_q": sigma_q, "v_phi": v_phi, "y0": y0, "y_pos": y_pos, "y_neg": y_neg})]

    def fit_loss(self, unit: FitUnit) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        x = unit.tensors
        with model_timestep(self.policy, query_timestep(x["sigma_q"], self.tcfg.model_timestep), x["sigma_q"]):
            v_theta = self.policy.velocity(x["z_q"], x["sigma_q"], unit.chunk.cond, self.fit_guidance(unit.chunk))
        return opsd_loss(v_theta, x["v_phi"], x["z_q"], x["sigma_q"], x["y_pos"], x["y_neg"], unit.r,
                         self.tcfg.mirror_beta, self.tcfg.adv_clip)
