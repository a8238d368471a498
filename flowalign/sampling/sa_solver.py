"""SA-Solver rollouts, as AWM's authors sample (``docs/methods/samplers.md``, ``docs/methods/awm.md``).

SA-Solver ("SA-Solver: Stochastic Adams Solver for Fast Sampling of Diffusion Models", arXiv 2309.05019) in
its data-prediction form for flow matching (α_t = 1 − t, σ_t = t, λ = log(α/σ)), predictor-corrector in PEC
mode, both of order 2, with the paper's few-step correction of the order-2 coefficients, the configuration
of AWM's released sampler. With the clean prediction ``D = x − t·v`` kept for the last steps, a step from
``s`` to ``t`` (``h = λ_t − λ_s``, stochasticity ``τ`` and ``c = 1 + τ²``) is

    x_t = e^{−τ²h}·(σ_t/σ_s)·x_s + c·σ_t·e^{−τ²λ_t}·Σ_i b_i·D_i + σ_t·√(1 − e^{−2τ²h})·ξ,

``b_i = ∫_{λ_s}^{λ_t} e^{cλ}·ℓ_i(λ) dλ`` for the Lagrange basis ``ℓ_i`` through the history's λ. The predictor
interpolates the last D's, the model is evaluated at the predicted state, and the corrector redoes the step
with that new D among its nodes and the same ξ. Its state therefore equals the predictor's plus the
difference of their D-terms, which is how the corrector is applied here. The first step is first order
without a corrector, and the step to t = 0 lands on the last clean prediction.

The rollout's latents are the states the model is evaluated at (the predictor's); the corrected states are
kept in ``SASolverSteps.corrected``. τ is ``noise_level`` on the steps whose target t lies in ``window``,
else 0; a step with τ > 0 is Gaussian and stores its log-probability.

Different from diffusers' ``SASolverScheduler``, which evaluates τ at a step's start, corrects the first step,
has no few-step correction and does not end on the clean prediction, so that class is not used here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from flowalign.errors import UserError
from flowalign.sampling.steps import StepOutput, draw_noise, gaussian_log_prob

#: the first grid point replaces t = 1, where λ is −∞ (the authors' 1 − 10⁻³)
FIRST_T = 1 - 1e-3


@dataclass(frozen=True)
class SASolver:
    """An SA-Solver rollout (compared by value: groups with equal solvers share a rollout batch).

    ``noise_level``: τ on the steps whose target t lies in ``window`` (inclusive); 0 is SA-Solver's ODE.
    """

    noise_level: float = 0.4
    window: tuple[float, float] = (0.3, 0.9)
    #: the transformer reads 1000·t, as the authors' model wrapper gives it
    timestep = "continuous"

    def __post_init__(self) -> None:
        if not (math.isfinite(self.noise_level) and 0 <= self.noise_level <= 10):
            raise UserError(f"SA-Solver noise_level must be in [0, 10], got {self.noise_level}")
        lo, hi = self.window
        if not (0 <= lo <= hi <= 1):
            raise UserError(f"SA-Solver window must be [low, high] with 0 <= low <= high <= 1, got {list(self.window)}")

    @property
    def name(self) -> str:
        return "sa_solver"

    def sigmas(self, policy_sigmas: Callable[[int], torch.Tensor], num_steps: int) -> torch.Tensor:
        """``(T+1,)`` float32: the policy's grid with its first point ``1 − 10⁻³``, the second-last halved
        from the third-last and the last 0 (the authors' changes to the scheduler's grid)."""
        if num_steps < 2:
            raise UserError(f"SA-Solver needs num_steps >= 2 (a first-order step, then the multistep ones), "
                            f"got {num_steps}")
        grid = policy_sigmas(num_steps).float().clone()
        grid[-2] = grid[-3] / 2
        grid[0] = FIRST_T
        grid[-1] = 0.0
        return grid

    def tau(self, t: float) -> float:
        """τ of a step that ends at ``t``."""
        return self.noise_level if self.window[0] <= t <= self.window[1] else 0.0

    def stochastic_steps(self, sigmas: torch.Tensor) -> torch.Tensor:
        """``(T,)`` bool: the steps that draw noise (τ > 0 at their target; never the step to t = 0)."""
        targets = sigmas[1:].tolist()
        return torch.tensor([self.tau(t) > 0 and k < len(targets) - 1 for k, t in enumerate(targets)])

    def steps(self, sigmas: torch.Tensor) -> "SASolverSteps":
        """The step function of one rollout along ``sigmas`` (stateful: build one per rollout)."""
        return SASolverSteps(sigmas, self)


def lam(t: float) -> float:
    """Half log-SNR ``λ = log((1 − t)/t)`` of flow matching."""
    return math.log((1 - t) / t)


def exp_integrals(lam_s: float, lam_t: float, c: float) -> tuple[float, float]:
    """``∫ e^{cλ} dλ`` and ``∫ e^{cλ}·λ dλ`` from ``lam_s`` to ``lam_t``."""
    i0 = (math.exp(c * lam_t) - math.exp(c * lam_s)) / c
    i1 = (math.exp(c * lam_t) * (c * lam_t - 1) - math.exp(c * lam_s) * (c * lam_s - 1)) / c**2
    return i0, i1


def adams_coefficients(lam_s: float, lam_t: float, nodes: list[float], tau: float) -> list[float]:
    """``b_i`` for the D's at λ ``nodes`` (one node: order 1; two: order 2, linear interpolation)."""
    c = 1 + tau**2
    i0, i1 = exp_integrals(lam_s, lam_t, c)
    if len(nodes) == 1:
        return [i0]
    a, b = nodes
    return [(i1 - b * i0) / (a - b), (i1 - a * i0) / (b - a)]


class SASolverSteps:
    """The steps of one SA-Solver rollout along ``sigmas`` ``(T+1,)``, called in order ``k = 0 … T−1`` with
    the velocity at the state the rollout holds (a step may be called again with the same state, as the
    rollout does to place per-sample noise; it recomputes the same values)."""

    def __init__(self, sigmas: torch.Tensor, solver: SASolver, keep_corrected: bool = False):
        self.t = [float(s) for s in sigmas]
        self.solver = solver
        #: D at the grid points the last steps evaluated (older ones are dropped)
        self.clean: dict[int, torch.Tensor] = {}
        #: with ``keep_corrected``, the corrector's state at each grid point k ≥ 1 (the first step has none)
        self.corrected: dict[int, torch.Tensor] | None = {} if keep_corrected else None

    def index(self, sigma: float) -> int:
        for k, t in enumerate(self.t[:-1]):
            if math.isclose(t, sigma, rel_tol=0, abs_tol=1e-6):
                return k
        raise ValueError(f"SA-Solver step called at sigma {sigma}, which is not on its grid: build one "
                         "SASolverSteps per rollout, on the grid SASolver.sigmas gives")

    def d_term(self, k: int, nodes: list[int], tau: float) -> torch.Tensor:
        """``c·σ_t·e^{−τ²λ_t}·Σ_i b_i·D_i`` of the step from grid point ``k−1`` to ``k``, D's at ``nodes``
        (most recent first), with the few-step correction of the order-2 coefficients."""
        t, s = self.t[k], self.t[k - 1]
        lam_t, lam_s = lam(t), lam(s)
        c, h = 1 + tau**2, lam_t - lam_s
        b = adams_coefficients(lam_s, lam_t, [lam(self.t[j]) for j in nodes], tau)
        if len(nodes) == 2:
            tail = (h * c - 1 + math.exp(-c * h)) / c**2
            if nodes[0] == k:  # corrector: its newest node is the target itself
                extra = math.exp(c * lam_t) * (h / 2 - tail / h)
            else:  # predictor
                extra = math.exp(c * lam_t) * (h**2 / 2 - tail) / (lam_s - lam(self.t[nodes[1]]))
            b = [b[0] + extra, b[1] - extra]
        scale = c * t * math.exp(-(tau**2) * lam_t)
        return sum(scale * bi * self.clean[j] for bi, j in zip(b, nodes))

    def __call__(self, velocity: torch.Tensor, sample: torch.Tensor, sigma: float, sigma_next: float,
                 generator: torch.Generator | None = None, prev_sample: torch.Tensor | None = None) -> StepOutput:
        k = self.index(sigma)
        t, T = self.t, len(self.t) - 1
        self.clean[k] = sample - t[k] * velocity.to(sample.dtype)
        for j in [j for j in self.clean if j < k - 2]:
            del self.clean[j]
        x = sample
        if k >= 2:  # the corrector: the predictor's state with its own D-term (same ξ, same τ)
            tau = self.solver.tau(t[k])
            x = sample + self.d_term(k, [k, k - 1], tau) - self.d_term(k, [k - 1, k - 2], tau)
        if k >= 1 and self.corrected is not None:
            self.corrected[k] = x
        n, ones = sample.shape[0], (1,) * (sample.ndim - 1)
        std = 0.0
        if k + 1 == T:  # denoise to zero: the last clean prediction
            mean = self.clean[k]
        else:
            tau = self.solver.tau(t[k + 1])
            h = lam(t[k + 1]) - lam(t[k])
            nodes = [k] if k == 0 else [k, k - 1]
            mean = math.exp(-(tau**2) * h) * (t[k + 1] / t[k]) * x + self.d_term(k + 1, nodes, tau)
            std = t[k + 1] * math.sqrt(-math.expm1(-2 * tau**2 * h))
        # std is a host number: a step never waits for the device to decide whether it is stochastic
        std_t = torch.full((n, *ones), std, dtype=mean.dtype, device=mean.device)
        if std == 0:
            return StepOutput(mean, torch.full((n,), float("nan"), device=mean.device), mean, std_t)
        prev_sample = (mean + std * draw_noise(mean, generator) if prev_sample is None else prev_sample).to(mean.dtype)
        return StepOutput(prev_sample, gaussian_log_prob(prev_sample, mean, std_t), mean, std_t)
