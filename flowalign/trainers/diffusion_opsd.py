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

Their appendix ablations are options, each off by default (the method): ``dual_negative`` (``opa_dual_neg``),
``direction`` (``opa_dir_mode``), ``query_state`` (``opa_state_mode``), ``target_mode``/``aux_weight``
(``opa_target_mode``/``opa_aux_lambda``) and ``certify``/``certify_margin`` (``opa_cert``/``opa_margin``);
known answers in ``tests/flowalign/trainers/known_answers/diffusion_opsd_ablations.json``.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch
from pydantic import Field, model_validator

from flowalign.errors import UserError
from flowalign.limits import MAX_COEFFICIENT, MAX_UPDATES
from flowalign.plan_holdings import Holding, StepHoldings
from flowalign.sampling import Rollout
from flowalign.sampling.ode_solvers import DPMSolverSteps, OdeSolver
from flowalign.sampling.timesteps import fixed, integer_timestep, model_timestep
from flowalign.trainers.parts.reductions import per_sample_mean
from flowalign.trainers.parts.negative_aware import mirrored_velocities
from flowalign.trainers.self_distill import FitUnit, SelfDistillConfig, SelfDistillTrainer


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
    # The authors' appendix ablations; each default is the method.
    #: their opa_dual_neg: both branches (true, their 1); false (their 0): the positive branch alone, the
    #: (1 − r) term of the loss is 0 (y⁻ is not built)
    dual_negative: bool = True
    #: their opa_dir_mode, the direction of the target steps: the reward gradient ("grad", the method), a Gaussian
    #: direction drawn per sample and sign ("random", their rand), the denoising residual x_i − y0 to the
    #: rollout's sample ("residual"), or no step, y± = y0 ("none", their noop)
    direction: Literal["grad", "random", "residual", "none"] = "grad"
    #: their opa_state_mode: the rollout's state z_q ("rollout", the method), or the rollout's sample
    #: forward-noised at σ_q, (1 − σ_q)·x_i + σ_q·ε, for the anchor, the targets and the fit ("forward")
    query_state: Literal["rollout", "forward"] = "rollout"
    #: their opa_target_mode: y± are the fit's targets ("replace", the method), or NFT's loss toward the rollout's
    #: sample x_i in both branches plus aux_weight × the loss toward y± ("aux")
    target_mode: Literal["replace", "aux"] = "replace"
    #: λ of target_mode aux (their opa_aux_lambda)
    aux_weight: float = Field(1.0, ge=0, le=MAX_COEFFICIENT)
    #: their opa_cert 1: each target is fitted only if φ's DPM-Solver++(2) suffix from z_q with y± forced as the
    #: clean prediction ends at a reward ≥ R(x_i) + certify_margin (y⁺), ≤ R(x_i) − certify_margin (y⁻)
    certify: bool = False
    #: the margin of certify (their opa_margin)
    certify_margin: float = Field(0.005, ge=0, le=MAX_COEFFICIENT)

    @model_validator(mode="after")
    def _certify_reads_the_rollout(self):
        if self.certify and self.query_state == "forward":
            raise ValueError("trainer.certify continues the rollout from its state z_q: a forward-noised query "
                             "state has no rollout to continue; use trainer.query_state=rollout")
        return self


# ---------------------------------------------------------------------------------------------- the loss


def query_index(sigmas: torch.Tensor, sigma_star: float) -> int:
    """``k_q = argmin_k |σ_k − σ*|`` over ``1 ≤ k ≤ T−1`` (a state strictly between noise and sample)."""
    inner = sigmas[1:-1] if len(sigmas) > 2 else sigmas[1:]
    return 1 + int(torch.argmin((inner - sigma_star).abs()))


def _ball_walk(y0: torch.Tensor, sign: float, first: torch.Tensor, direction_at, budget: torch.Tensor,
               h: torch.Tensor, n: int) -> torch.Tensor:
    """``n`` normalised steps ``y ← y + sign·h·g/(‖g‖ + 1e-12)`` from ``y0``, ``g`` = ``first`` at the first step
    and ``direction_at(y)`` after, each projected onto the ball ``‖y − y0‖ ≤ budget`` (per sample); detached."""
    shape = (-1,) + (1,) * (y0.ndim - 1)
    y = y0
    for i in range(n):
        g = first if i == 0 else direction_at(y)
        y = y + sign * h * g / (g.flatten(1).norm(dim=1).view(shape) + 1e-12)
        off = y - y0
        # the authors' projection: scale min(b/(‖y − y0‖ + 1e-12), 1), so a zero step stays at y0
        scale = (budget / (off.flatten(1).norm(dim=1).view(shape) + 1e-12)).clamp(max=1.0)
        y = y0 + off * scale
    return y.detach()


def _budget(y0: torch.Tensor, rho: float, n: int, eta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(b, h)``: the ball's radius ``b = ρ‖y0‖`` and the step ``h = η·b/n``, per sample."""
    shape = (-1,) + (1,) * (y0.ndim - 1)
    budget = rho * y0.flatten(1).norm(dim=1).view(shape)
    return budget, eta * budget / n


def bounded_targets(
    y0: torch.Tensor, grad_fn, rho: float, n: int, eta: float, negative: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(y⁺, y⁻)`` detached, each ``(B, ...)``: ``n`` normalised reward-gradient steps from ``y0`` in each
    direction, projected onto the ball ``‖y − y0‖ ≤ b = ρ‖y0‖`` (per sample), step ``h = η·b/n``.

    ``grad_fn(y) -> ∇_y R`` (same shape); the first gradient, at ``y0``, is shared by both directions.
    ``negative`` False: ``y⁻`` is not built (None).
    """
    y0 = y0.detach()
    budget, h = _budget(y0, rho, n, eta)
    g0 = grad_fn(y0)
    y_pos = _ball_walk(y0, 1.0, g0, grad_fn, budget, h, n)
    return y_pos, _ball_walk(y0, -1.0, g0, grad_fn, budget, h, n) if negative else None


def fixed_direction_targets(
    y0: torch.Tensor, d_pos: torch.Tensor, d_neg: torch.Tensor | None, rho: float, n: int, eta: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(y⁺, y⁻)`` as :func:`bounded_targets` with a fixed direction in place of the reward gradient: ``+d_pos``
    at every step of ``y⁺``, ``−d_neg`` at every step of ``y⁻`` (None: no ``y⁻``); their ``opa_dir_mode``
    ``rand`` (two independent Gaussian draws) and ``residual`` (``x_i − y0`` for both)."""
    y0 = y0.detach()
    budget, h = _budget(y0, rho, n, eta)
    y_pos = _ball_walk(y0, 1.0, d_pos, lambda y: d_pos, budget, h, n)
    return y_pos, None if d_neg is None else _ball_walk(y0, -1.0, d_neg, lambda y: d_neg, budget, h, n)


def direction_targets(
    direction: str, y0: torch.Tensor, rho: float, n: int, eta: float, *, gradient=None,
    x_end: torch.Tensor | None = None, draw=None, negative: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(y⁺, y⁻)`` of the ``direction`` option (their ``opa_dir_mode``; ``negative`` False: no ``y⁻``):
    ``"grad"``: :func:`bounded_targets` with ``gradient(y) -> ∇_y R``; ``"random"``: :func:`fixed_direction_targets`
    along ``draw()`` for ``y⁺``, then a second ``draw()`` for ``y⁻``; ``"residual"``: along ``x_end − y0`` (the
    rollout's sample ``x_i``) for both; ``"none"``: ``y± = y0``."""
    if direction == "grad":
        return bounded_targets(y0, gradient, rho, n, eta, negative)
    y0 = y0.detach()
    if direction == "none":
        return y0, y0 if negative else None
    if direction == "random":
        d_pos = draw()
        d_neg = draw() if negative else None
    elif direction == "residual":
        d_pos = x_end.to(y0.dtype) - y0
        d_neg = d_pos if negative else None
    else:
        raise ValueError(f"unknown target direction {direction!r}")
    return fixed_direction_targets(y0, d_pos, d_neg, rho, n, eta)


def forward_query_state(x_end: torch.Tensor, sigma_q: float, noise: torch.Tensor) -> torch.Tensor:
    """``(1 − σ_q)·x_i + σ_q·ε`` ``(B, ...)``: the rollout's sample ``x_i`` forward-noised to σ_q (``query_state:
    forward``, their ``opa_state_mode forward``)."""
    return (1.0 - sigma_q) * x_end + sigma_q * noise


def query_timestep(sigma_q: float, form: str):
    """The transformer's timestep at the query state: their ``int(1000·σ_q)`` (σ_q a Python float, the product
    in double precision, as their anchor and fit compute it) for ``"truncated"``; None (the pipeline's
    ``1000·σ_q``) for ``"continuous"``."""
    return fixed(integer_timestep(sigma_q)) if form == "truncated" else None


@torch.no_grad()
def query_anchor(policy, chunk: Rollout, sigma_star: float, guidance: float | None = None,
                 timestep: str = "continuous", noise: torch.Tensor | None = None,
                 ) -> tuple[float, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(σ_q, z_q, v(z_q), y0 = z_q − σ_q·v(z_q))`` of a rollout at its query state (``z_q``, ``v``, ``y0``:
    ``(B, ...)``); the velocity is the live weights' (the trainer swaps φ in first), at CFG ``guidance``
    (None: the rollout's), the transformer reading the ``timestep`` form (:func:`query_timestep`).
    ``noise`` ``(B, ...)``: ``z_q`` is the rollout's sample forward-noised with it (:func:`forward_query_state`)
    instead of the rollout's own state."""
    k = query_index(chunk.sigmas, sigma_star)
    sigma_q = chunk.sigmas[k].item()
    if noise is None:
        z_q = chunk.latents[:, k].to(policy.device)
    else:
        z_q = forward_query_state(chunk.latents[:, -1].to(policy.device), sigma_q, noise.to(policy.device))
    with model_timestep(policy, query_timestep(sigma_q, timestep), sigma_q):
        v = policy.velocity(z_q, sigma_q, chunk.cond, chunk.guidance_scale if guidance is None else guidance)
    return sigma_q, z_q, v, z_q - sigma_q * v


def velocity_at(policy, chunk: Rollout, guidance: float, timestep: str):
    """``(z, σ) ↦ v(z, σ)`` of the live weights for this chunk's prompts at CFG ``guidance``, the transformer
    reading the ``timestep`` form at σ (their ``vold``)."""
    def velocity(z: torch.Tensor, sigma: float) -> torch.Tensor:
        with model_timestep(policy, query_timestep(sigma, timestep), sigma):
            return policy.velocity(z, sigma, chunk.cond, guidance)
    return velocity


@torch.no_grad()
def dpm2_suffix(velocity, z_q: torch.Tensor, k: int, forced_x0: torch.Tensor, prev_x0: torch.Tensor,
                sigmas: torch.Tensor) -> torch.Tensor:
    """The sample ``(B, ...)`` (float32) of the multistep DPM-Solver++(2) run from ``z_q`` at step ``k`` of
    ``sigmas`` ``(T+1,)`` to σ = 0, with ``forced_x0`` as the clean prediction of step ``k`` and ``prev_x0`` (step
    ``k − 1``'s) as the solver's history; the later steps read ``velocity(z, σ)`` (their ``_dpm2_continue_from``)."""
    steps = DPMSolverSteps(sigmas)
    steps.resume_at(k, prev_x0)
    z = z_q.detach().float()
    grid = [float(s) for s in sigmas]
    # the velocity whose clean prediction z − σ_k·v is forced_x0
    v = (z - forced_x0.detach().float()) / grid[k]
    z = steps(v, z, grid[k], grid[k + 1]).prev_sample
    for i in range(k + 1, len(grid) - 1):
        z = steps(velocity(z, grid[i]).float(), z, grid[i], grid[i + 1]).prev_sample
    return z


def certificates(r_old: torch.Tensor, r_pos: torch.Tensor, r_neg: torch.Tensor | None,
                 margin: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(a⁺, a⁻)`` ``(B,)`` in {0, 1}: ``R(y⁺'s sample) ≥ R(x_i) + margin``, ``R(y⁻'s sample) ≤ R(x_i) − margin``."""
    acc_pos = (r_pos >= r_old + margin).float()
    return acc_pos, None if r_neg is None else (r_neg <= r_old - margin).float()


def normalised_error(y_hat: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``mean((ŷ − y)²/w)`` ``(B,)`` with ``w = sg(max(mean|ŷ − y|, 1e-5))`` per sample, ``w`` in float64 as the
    authors compute it (``ŷ``, ``y``: ``(B, ...)``; the result is float64, its gradient reaches ``ŷ`` only)."""
    with torch.no_grad():
        w = per_sample_mean((y_hat.double() - y.double()).abs()).clamp(min=1e-5)
    return per_sample_mean((y_hat - y) ** 2 / w.view(-1, *([1] * (y.ndim - 1))))


def opsd_loss(
    v_theta: torch.Tensor, v_phi: torch.Tensor, z_q: torch.Tensor, sigma_q: float, y_pos: torch.Tensor,
    y_neg: torch.Tensor | None, r: torch.Tensor, beta: float, a_max: float, *, dual_negative: bool = True,
    endpoint: torch.Tensor | None = None, aux_weight: float = 1.0, accept_pos: torch.Tensor | None = None,
    accept_neg: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-sample OPSD fitting loss ``(B,)``: ``A_max·[r·mean(ŷ⁺−y⁺)²/w⁺ + (1−r)·mean(ŷ⁻−y⁻)²/w⁻]``.

    ``w± = sg(max(mean|ŷ± − y±|, 1e-5))``; ``v_phi``, ``z_q``, ``y±``, ``r`` are constants. The ablations
    (defaults: the method): ``dual_negative`` False drops the ``(1 − r)`` term (``y_neg`` may be None);
    ``accept_pos``/``accept_neg`` ``(B,)`` multiply each branch (certification); ``endpoint`` ``x_i``
    ``(B, ...)`` makes it ``A_max·[r·mean(ŷ⁺−x_i)²/w⁺₀ + (1−r)·mean(ŷ⁻−x_i)²/w⁻₀] + aux_weight·`` the above
    (``target_mode: aux``, the endpoint branches ungated).
    """
    v_pos, v_neg = mirrored_velocities(v_theta, v_phi.detach(), beta)
    y_hat_pos, y_hat_neg = z_q - sigma_q * v_pos, z_q - sigma_q * v_neg
    pos = normalised_error(y_hat_pos, y_pos)
    neg = normalised_error(y_hat_neg, y_neg) if dual_negative else torch.zeros_like(pos)
    if accept_pos is not None:
        pos = accept_pos * pos
    if accept_neg is not None and dual_negative:
        neg = accept_neg * neg
    loss = a_max * (r * pos + (1 - r) * neg)
    info = {"loss_pos": pos.detach().mean(), "loss_neg": neg.detach().mean()}
    if endpoint is not None:
        main_pos = normalised_error(y_hat_pos, endpoint)
        main_neg = normalised_error(y_hat_neg, endpoint) if dual_negative else torch.zeros_like(main_pos)
        loss = a_max * (r * main_pos + (1 - r) * main_neg) + aux_weight * loss
        info.update(loss_endpoint_pos=main_pos.detach().mean(), loss_endpoint_neg=main_neg.detach().mean())
    return loss, info


# ---------------------------------------------------------------------------------------------- hooks


class DiffusionOPSDTrainer(SelfDistillTrainer):
    Config = DiffusionOPSDConfig
    tcfg: DiffusionOPSDConfig

    @classmethod
    def step_holdings(cls, tcfg: DiffusionOPSDConfig) -> StepHoldings:
        """The loop's rollouts, and (``direction: grad``) the targets' reward gradients: each training chunk's
        anchors decoded with grad and backpropagated to, under φ swapped in, while the step's rollouts are held
        (:meth:`fit_units` from :meth:`plan`, before the optimiser steps, the gradients freed)."""
        base = super().step_holdings(tcfg)
        if tcfg.direction != "grad":
            return base
        gradient = Holding(rollouts=tcfg.group_size, swapping=True, reward_gradient=True)
        return dataclasses.replace(base, moments=(*base.moments, gradient))

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
        """Query state, anchor ``y0`` and targets ``y±`` under φ (the caller swapped φ in); with the ablations,
        the random draws (the forward state's ε, then the random directions) come from ``generator``."""
        t = self.tcfg
        x_end = chunk.latents[:, -1].to(self.policy.device)
        noise = self.normal(x_end, generator) if t.query_state == "forward" else None
        sigma_q, z_q, v_phi, y0 = query_anchor(self.policy, chunk, t.sigma_star, self.fit_guidance(chunk),
                                               t.model_timestep, noise)
        # y ↦ ∇_y Σ_j w_j R_j(D(y), c) for this chunk's prompts, through the VAE decoder
        gradient = (self.reward_gradient(chunk.prompts, chunk.metadata, t.decoder_checkpointing)
                    if t.direction == "grad" else None)
        y_pos, y_neg = direction_targets(t.direction, y0, t.rho, t.ascent_steps, t.eta, gradient=gradient,
                                         x_end=x_end, draw=lambda: self.normal(y0, generator),
                                         negative=t.dual_negative)
        tensors = {"z_q": z_q, "sigma_q": sigma_q, "v_phi": v_phi, "y0": y0, "y_pos": y_pos}
        if y_neg is not None:
            tensors["y_neg"] = y_neg
        if t.target_mode == "aux":
            tensors["endpoint"] = x_end
        if t.certify:
            tensors["accept_pos"], accept_neg = self.certified(chunk, z_q, x_end, y_pos, y_neg)
            if accept_neg is not None:
                tensors["accept_neg"] = accept_neg
        return [FitUnit(chunk, r.to(y0.device, non_blocking=True), keep, tensors)]

    @staticmethod
    def normal(like: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """A standard normal draw shaped as ``like`` (float32 from the CPU ``generator``), on its device and dtype."""
        return torch.randn(like.shape, generator=generator, dtype=torch.float32).to(like.device, like.dtype)

    @torch.no_grad()
    def suffix_samples(self, chunk: Rollout, z_q: torch.Tensor, *forced: torch.Tensor) -> list[torch.Tensor]:
        """For each of ``forced`` ``(B, ...)``: the sample of φ's DPM-Solver++(2) run from the rollout's ``z_q``
        with it as the clean prediction at ``k_q``, the solver's history the clean prediction at the state before
        (:func:`dpm2_suffix`; every velocity at the fit's CFG and timestep form, as the anchor's)."""
        t = self.tcfg
        k = query_index(chunk.sigmas, t.sigma_star)
        velocity = velocity_at(self.policy, chunk, self.fit_guidance(chunk), t.model_timestep)
        sigma_prev = chunk.sigmas[k - 1].item()
        z_prev = chunk.latents[:, k - 1].to(z_q.device)
        prev_x0 = z_prev - sigma_prev * velocity(z_prev, sigma_prev)
        return [dpm2_suffix(velocity, z_q, k, x0, prev_x0, chunk.sigmas) for x0 in forced]

    @torch.no_grad()
    def certified(self, chunk: Rollout, z_q: torch.Tensor, x_end: torch.Tensor, y_pos: torch.Tensor,
                  y_neg: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(a⁺, a⁻)`` ``(B,)`` (``a⁻`` None without ``y_neg``): the weighted reward of the decoded
        :meth:`suffix_samples` with ``y±`` forced, against the rollout's sample ``x_end`` (:func:`certificates`)."""
        def reward(latents: torch.Tensor) -> torch.Tensor:
            return self.rewards.weighted_total(self.policy.decode(latents), chunk.prompts, chunk.metadata)

        samples = self.suffix_samples(chunk, z_q, *([y_pos] if y_neg is None else [y_pos, y_neg]))
        r_neg = None if y_neg is None else reward(samples[1])
        return certificates(reward(x_end), reward(samples[0]), r_neg, self.tcfg.certify_margin)

    def fit_loss(self, unit: FitUnit) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        t, x = self.tcfg, unit.tensors
        with model_timestep(self.policy, query_timestep(x["sigma_q"], t.model_timestep), x["sigma_q"]):
            v_theta = self.policy.velocity(x["z_q"], x["sigma_q"], unit.chunk.cond, self.fit_guidance(unit.chunk))
        loss, info = opsd_loss(v_theta, x["v_phi"], x["z_q"], x["sigma_q"], x["y_pos"], x.get("y_neg"), unit.r,
                               t.mirror_beta, t.adv_clip, dual_negative=t.dual_negative, endpoint=x.get("endpoint"),
                               aux_weight=t.aux_weight, accept_pos=x.get("accept_pos"),
                               accept_neg=x.get("accept_neg"))
        if t.certify:
            info["accept_pos"] = x["accept_pos"].mean()
            if "accept_neg" in x:
                info["accept_neg"] = x["accept_neg"].mean()
        return loss, info
