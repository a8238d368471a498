"""Pure step math of the rollout samplers (``docs/methods/samplers.md``), in diffusers' ``step()`` habit.

One step maps ``x_k`` at ``σ_k`` to ``x_{k+1}`` at ``σ_{k+1} < σ_k`` given the velocity ``v``. Every
function works in float32 whatever the model's dtype (bf16 overflows in the log-prob), accepts σ as a
float or a ``(B,)`` tensor, and, given ``prev_sample``, re-evaluates the log-probability of a stored
transition instead of drawing a new one (how trainers compute ratios).

Shapes: ``velocity`` and ``sample`` are ``(B, ...)`` (any latent layout); ``log_prob`` is ``(B,)``, the
per-element *mean* over the non-batch dimensions (the Flow-GRPO convention: summing would change the
meaning of the clip range).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Literal

import torch

SamplerKind = Literal["ode", "flow_grpo", "cps", "dance", "flow_grpo_floored"]
SAMPLER_KINDS: tuple[str, ...] = ("ode", "flow_grpo", "cps", "dance", "flow_grpo_floored")
#: σ from which ``flow_grpo_floored`` floors the noise scale's denominator ``1 − σ`` at ``1 − 0.95``
FLOOR_SIGMA = 0.95
#: a noise level σ: one float for the batch or a ``(B,)`` tensor
Sigma = float | torch.Tensor
#: how CPS scores a transition (see :func:`cps_step`)
LogProbMode = Literal["code", "gaussian"]
_HALF_LOG_2PI = 0.5 * math.log(2 * math.pi)


@dataclass
class StepOutput:
    """Result of one sampler step.

    ``prev_sample``: ``x_{k+1}`` ``(B, ...)`` (diffusers' name for the less noisy latent);
    ``log_prob``: ``(B,)``, NaN where the step is deterministic; ``mean``: ``μ`` ``(B, ...)``;
    ``std``: ``τ`` broadcastable to ``mean`` (zeros on deterministic steps).
    """

    prev_sample: torch.Tensor
    log_prob: torch.Tensor
    mean: torch.Tensor
    std: torch.Tensor


#: one rollout step, a sampler kind's or a custom one: ``fn(velocity, sample, sigma, sigma_next, generator,
#: prev_sample) -> StepOutput``
StepFn = Callable[..., StepOutput]


def batch_values(value: float | torch.Tensor, batch: int, device: torch.device | str) -> torch.Tensor:
    """``value`` (a float, a 0-d or a ``(B,)`` tensor) as a float32 ``(B,)`` tensor on ``device``, without
    making the host wait for the device: a float or a CPU scalar is filled in on the device (where
    ``torch.as_tensor(value, device=cuda)`` copies it and waits for everything queued before), a tensor is
    moved without blocking. The values are ``torch.as_tensor(value, dtype=float32)``'s."""
    if isinstance(value, torch.Tensor) and value.ndim == 0 and value.device.type == "cpu":
        value = value.item()  # a CPU scalar: reading it waits for nothing
    if isinstance(value, (int, float)):
        return torch.full((batch,), float(value), dtype=torch.float32, device=device)
    s = torch.as_tensor(value).to(device=device, dtype=torch.float32, non_blocking=True)
    return s.expand(batch) if s.ndim == 0 else s


def _as_batch_column(sigma: float | torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """σ as a float32 tensor of shape ``(B, 1, ..., 1)`` broadcastable against ``like``, on its device."""
    s = batch_values(sigma, like.shape[0], like.device)
    if s.shape != (like.shape[0],):
        raise ValueError(f"sigma must be a float or a (B,)=({like.shape[0]},) tensor, got shape {tuple(s.shape)}")
    return s.view(-1, *([1] * (like.ndim - 1)))


def draw_noise(like: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Standard normal noise shaped like ``like`` (float32, on its device) from ``generator``."""
    device = generator.device if generator is not None else like.device
    # drawn on the generator's device (the CPU for a seeded stream): the copy need not wait for the device
    return torch.randn(like.shape, generator=generator, device=device, dtype=torch.float32).to(like.device,
                                                                                               non_blocking=True)


def gaussian_log_prob(x_next: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """Per-element mean of ``log N(x_next; mean, std²)`` over non-batch dims: ``(B,)``."""
    lp = -((x_next - mean) ** 2) / (2 * std**2) - torch.log(std) - _HALF_LOG_2PI
    return lp.flatten(1).mean(1)


def _finish(
    mean: torch.Tensor, std: torch.Tensor, generator: torch.Generator | None, prev_sample: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    x_next = mean + std * draw_noise(mean, generator) if prev_sample is None else prev_sample.float()
    return x_next, gaussian_log_prob(x_next, mean, std)


def euler_step(
    velocity: torch.Tensor, sample: torch.Tensor, sigma: float | torch.Tensor, sigma_next: float | torch.Tensor
) -> StepOutput:
    """Deterministic Euler ODE step ``x + (σ' − σ)·v``; log-prob NaN."""
    v, x = velocity.float(), sample.float()
    dt = _as_batch_column(sigma_next, x) - _as_batch_column(sigma, x)
    x_next = x + dt * v
    nan = torch.full((x.shape[0],), float("nan"), device=x.device)
    return StepOutput(x_next, nan, x_next, torch.zeros_like(dt))


def flow_sde_step(
    velocity: torch.Tensor,
    sample: torch.Tensor,
    sigma: float | torch.Tensor,
    sigma_next: float | torch.Tensor,
    *,
    diffusion: float | torch.Tensor,
    generator: torch.Generator | None = None,
    prev_sample: torch.Tensor | None = None,
) -> StepOutput:
    """Euler-Maruyama step of the marginal-preserving reverse SDE with diffusion coefficient ``s``.

    ``dx = [v + (s²/(2σ))(x + (1-σ)v)] dσ + s dw``: mean
    ``μ = x(1 + s²Δ/(2σ)) + v(1 + s²(1-σ)/(2σ))Δ``, std ``τ = s·sqrt(-Δ)``. Flow-GRPO, DanceGRPO and
    Flash-GRPO differ only in how ``s`` is chosen, so they all call this with their own ``s``
    (a float or a ``(B,)`` tensor).
    """
    mean, std = flow_sde_moments(velocity, sample, sigma, sigma_next, diffusion=diffusion)
    x_next, log_prob = _finish(mean, std, generator, prev_sample)
    return StepOutput(x_next, log_prob, mean, std)


def flow_sde_moments(
    velocity: torch.Tensor, sample: torch.Tensor, sigma: Sigma, sigma_next: Sigma, *, diffusion: Sigma,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The mean ``μ (B, ...)`` and std ``τ (B, 1, ..., 1)`` of :func:`flow_sde_step`'s transition, float32."""
    v, x = velocity.float(), sample.float()
    sig, sig_next = _as_batch_column(sigma, x), _as_batch_column(sigma_next, x)
    s = _as_batch_column(diffusion, x)
    dt = sig_next - sig
    mean = x * (1 + s**2 * dt / (2 * sig)) + v * (1 + s**2 * (1 - sig) / (2 * sig)) * dt
    return mean, s * torch.sqrt(-dt)


def flow_grpo_diffusion(
    sigma: float | torch.Tensor, sigma_next: float | torch.Tensor, noise_level: float
) -> torch.Tensor:
    """Flow-GRPO's ``s_k = a·sqrt(σ_k / (1 − σ̃_k))`` with ``σ̃_k = σ_{k+1}`` when ``σ_k = 1`` [code].

    At σ=1 the authors substitute the grid's next sigma to avoid dividing by zero; within a step that
    is ``sigma_next``.
    """
    sig = torch.as_tensor(sigma, dtype=torch.float32)
    sig_tilde = torch.where(sig >= 1.0, torch.as_tensor(sigma_next, dtype=torch.float32), sig)
    return noise_level * torch.sqrt(sig / (1 - sig_tilde))


def floored_flow_grpo_diffusion(sigma: Sigma, noise_level: float, floor: float = FLOOR_SIGMA) -> torch.Tensor:
    """``s = a·sqrt(σ / (1 − min(σ, floor)))``: Flow-GRPO's noise scale with its denominator floored at
    ``1 − floor`` for every ``σ ≥ floor`` (UMM-Reflection's ``r3_t_ge_0p95`` clamp), where Flow-GRPO substitutes
    only at ``σ = 1``; ``(B,)`` or a 0-d tensor, float32."""
    sig = torch.as_tensor(sigma, dtype=torch.float32)
    return noise_level * torch.sqrt(sig / (1 - torch.clamp(sig, max=floor)))


def floored_flow_sde_step(
    velocity: torch.Tensor, sample: torch.Tensor, sigma: Sigma, sigma_next: Sigma, *, noise_level: float,
    generator: torch.Generator | None = None, prev_sample: torch.Tensor | None = None,
) -> StepOutput:
    """The Flow-GRPO SDE step (:func:`flow_sde_step`) with the floored noise scale
    :func:`floored_flow_grpo_diffusion`, scored as UMM-Reflection scores it: ``log_prob`` is the per-element mean
    of ``−(x' − μ)²/(2τ²)`` without ``−log τ − ½·log 2π`` (constant in θ, so ratios and KLs are unchanged)."""
    s = floored_flow_grpo_diffusion(sigma, noise_level)
    out = flow_sde_step(velocity, sample, sigma, sigma_next, diffusion=s, generator=generator, prev_sample=prev_sample)
    log_prob = (-((out.prev_sample - out.mean) ** 2) / (2 * out.std**2)).flatten(1).mean(1)
    return StepOutput(out.prev_sample, log_prob, out.mean, out.std)


def cps_step(
    velocity: torch.Tensor, sample: torch.Tensor, sigma: Sigma, sigma_next: Sigma, *, eta: float,
    generator: torch.Generator | None = None, prev_sample: torch.Tensor | None = None,
    log_prob_mode: LogProbMode = "code",
) -> StepOutput:
    """Coefficients-preserving sampling step (CPS, arXiv 2509.05952).

    ``τ = σ'·sin(ηπ/2)``, ``μ = (1-σ')·x̂0 + sqrt(σ'² − τ²)·x̂1`` with ``x̂0 = x − σv``,
    ``x̂1 = x + (1−σ)v``. The noise coefficients square-sum to σ'² (no excess noise); η=0 is DDIM, i.e.
    Euler. Not marginal-preserving at finite η with posterior-mean predictions (it under-disperses).
    ``log_prob_mode="code"`` is the authors' ``-mean_D (x'−μ)²`` (constants and 1/(2τ²) dropped; their
    clip range 1e-5 is tuned to it); ``"gaussian"`` is the true per-element mean Gaussian log-density.
    """
    mean, std = cps_moments(velocity, sample, sigma, sigma_next, eta=eta)
    x_next = mean + std * draw_noise(mean, generator) if prev_sample is None else prev_sample.float()
    if log_prob_mode == "code":
        log_prob = -((x_next - mean) ** 2).flatten(1).mean(1)
    elif log_prob_mode == "gaussian":
        log_prob = gaussian_log_prob(x_next, mean, std)
    else:
        raise ValueError(f"cps log_prob_mode must be 'code' or 'gaussian', got {log_prob_mode!r}")
    return StepOutput(x_next, log_prob, mean, std)


def cps_moments(
    velocity: torch.Tensor, sample: torch.Tensor, sigma: Sigma, sigma_next: Sigma, *, eta: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The mean ``μ (B, ...)`` and std ``τ (B, 1, ..., 1)`` of :func:`cps_step`'s transition, float32."""
    v, x = velocity.float(), sample.float()
    sig, sig_next = _as_batch_column(sigma, x), _as_batch_column(sigma_next, x)
    x0_hat = x - sig * v
    x1_hat = x + (1 - sig) * v
    std = sig_next * math.sin(eta * math.pi / 2)
    return (1 - sig_next) * x0_hat + torch.sqrt(sig_next**2 - std**2) * x1_hat, std


def sde_step(
    kind: SamplerKind, velocity: torch.Tensor, sample: torch.Tensor, sigma: Sigma, sigma_next: Sigma, *,
    noise_level: float, generator: torch.Generator | None = None, prev_sample: torch.Tensor | None = None,
    cps_log_prob: LogProbMode = "code",
) -> StepOutput:
    """One rollout step of the sampler ``kind`` (``"ode" | "flow_grpo" | "cps" | "dance" | "flow_grpo_floored"``).

    ``noise_level`` is a (Flow-GRPO, default 0.7; ``flow_grpo_floored``: :func:`floored_flow_sde_step`, 1.0),
    η (CPS, 0.8) or η (DanceGRPO, 0.3). A zero noise
    level, a step that lands on σ'=0 with CPS, and ``"ode"`` give the deterministic Euler step with a
    NaN log-prob (a log-prob there would divide by zero).
    """
    if kind not in SAMPLER_KINDS:
        raise ValueError(f"unknown sampler kind {kind!r}; choose one of {', '.join(SAMPLER_KINDS)}")
    if noise_level < 0:
        raise ValueError(f"noise_level must be >= 0, got {noise_level}")
    if kind == "ode" or noise_level == 0:
        return euler_step(velocity, sample, sigma, sigma_next)
    if kind == "flow_grpo":
        s = flow_grpo_diffusion(sigma, sigma_next, noise_level)
        return flow_sde_step(velocity, sample, sigma, sigma_next, diffusion=s, generator=generator, prev_sample=prev_sample)
    if kind == "flow_grpo_floored":
        return floored_flow_sde_step(velocity, sample, sigma, sigma_next, noise_level=noise_level, generator=generator,
                                     prev_sample=prev_sample)
    if kind == "dance":
        return flow_sde_step(
            velocity, sample, sigma, sigma_next, diffusion=noise_level, generator=generator, prev_sample=prev_sample
        )
    if torch.any(torch.as_tensor(sigma_next) <= 0):
        return euler_step(velocity, sample, sigma, sigma_next)
    return cps_step(
        velocity, sample, sigma, sigma_next, eta=noise_level, generator=generator,
        prev_sample=prev_sample, log_prob_mode=cps_log_prob,
    )
