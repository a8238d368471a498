"""Deterministic rollout solvers besides the policy's Euler steps (``docs/methods/samplers.md``).

An :class:`OdeSolver` is passed to :func:`flowalign.sampling.rollout` as its ``sampler``. ``dpm2`` is the
multistep DPM-Solver++(2) of diffusers' ``DPMSolverMultistepScheduler`` with flow prediction (the
configuration Sana's diffusers conversion writes: ``dpmsolver++``, order 2, ``midpoint``, first-order
first and last steps, final σ = 0), run either on the policy's own σ grid or on the scheduler's own flow
grid. Both solvers are deterministic: the rollout's log-probabilities are NaN.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Literal

import torch

from flowalign.errors import UserError
from flowalign.sampling.steps import StepOutput, euler_step

SolverName = Literal["euler", "dpm2"]
GridName = Literal["policy", "flow_shift"]
TimestepForm = Literal["continuous", "truncated"]


@dataclass(frozen=True)
class OdeSolver:
    """How an ODE rollout integrates (compared by value: groups with equal solvers share a rollout batch).

    ``solver``: ``"euler"`` or ``"dpm2"`` (multistep DPM-Solver++(2)). ``grid``: ``"policy"`` (the policy's
    own σ grid, ``policy.sigmas(T)``) or ``"flow_shift"`` (``DPMSolverMultistepScheduler``'s own flow grid:
    ``s·u/(1 + (s−1)·u)`` for ``u = linspace(1 − 1/1000, 0, T+1)`` without its last point, then 0, with
    ``s = flow_shift``). ``timestep``: what the transformer reads, ``"continuous"`` ``1000·σ`` or
    ``"truncated"`` ``trunc(1000·σ)`` (pipelines that hand the model an integer timestep).
    """

    solver: SolverName = "euler"
    grid: GridName = "policy"
    flow_shift: float = 3.0
    timestep: TimestepForm = "continuous"

    def __post_init__(self) -> None:
        if self.solver not in ("euler", "dpm2"):
            raise UserError(f"unknown ODE solver {self.solver!r}; choose 'euler' or 'dpm2'")
        if self.grid not in ("policy", "flow_shift"):
            raise UserError(f"unknown ODE grid {self.grid!r}; choose 'policy' or 'flow_shift'")
        if self.timestep not in ("continuous", "truncated"):
            raise UserError(f"unknown timestep form {self.timestep!r}; choose 'continuous' or 'truncated'")
        if not (math.isfinite(self.flow_shift) and self.flow_shift > 0):
            raise UserError(f"flow_shift must be a positive number, got {self.flow_shift}")

    @property
    def name(self) -> str:
        """The rollout's ``sampler`` record: ``"ode"`` for Euler (as the plain ODE sampler), else the solver."""
        return "ode" if self.solver == "euler" else self.solver

    def sigmas(self, policy_sigmas: Callable[[int], torch.Tensor], num_steps: int) -> torch.Tensor:
        """The ``(T+1,)`` float32 grid this solver runs on (``policy_sigmas``: the policy's ``sigmas``)."""
        if self.grid == "policy":
            return policy_sigmas(num_steps).float()
        scheduler = dpm_solver_scheduler(self.flow_shift)
        scheduler.set_timesteps(num_steps)
        return scheduler.sigmas.float().clone()

    @property
    def noise_level(self) -> float:
        """No step of these solvers draws noise."""
        return 0.0

    def stochastic_steps(self, sigmas: torch.Tensor) -> torch.Tensor:
        """``(T,)`` bool: none (every step of these solvers is deterministic)."""
        return torch.zeros(len(sigmas) - 1, dtype=torch.bool)

    def steps(self, sigmas: torch.Tensor) -> Callable[..., StepOutput]:
        """A step function for one rollout along ``sigmas`` (stateful for ``dpm2``: build one per rollout)."""
        if self.solver == "euler":
            return lambda v, x, sigma, sigma_next, generator, prev_sample: euler_step(v, x, sigma, sigma_next)
        return DPMSolverSteps(sigmas, self.flow_shift)


def dpm_solver_scheduler(flow_shift: float = 3.0):
    """diffusers' ``DPMSolverMultistepScheduler`` for flow matching, as Sana's diffusers conversion
    configures it (every other field at its default: ``dpmsolver++``, order 2, ``midpoint``,
    ``lower_order_final``, ``final_sigmas_type: zero``)."""
    from diffusers import DPMSolverMultistepScheduler  # the sampler's only diffusers dependency, loaded on use

    return DPMSolverMultistepScheduler(use_flow_sigmas=True, prediction_type="flow_prediction", flow_shift=flow_shift)


class DPMSolverSteps:
    """The steps of one DPM-Solver++(2) rollout along ``sigmas`` ``(T+1,)``, called in order ``k = 0 … T−1``.

    The scheduler keeps the previous step's clean prediction ``x̂0 = x − σ·v`` (the multistep history);
    a step given another σ than the grid's next one is refused rather than silently mis-integrated.
    """

    def __init__(self, sigmas: torch.Tensor, flow_shift: float = 3.0):
        self.scheduler = dpm_solver_scheduler(flow_shift)
        self.scheduler.set_timesteps(len(sigmas) - 1)
        # the scheduler builds its own flow grid; the policy's grid replaces it (its steps read only sigmas)
        self.scheduler.sigmas = sigmas.detach().float().cpu().clone()
        self.scheduler.set_begin_index(0)
        self.k = 0

    def resume_at(self, k: int, previous_x0: torch.Tensor) -> None:
        """Continue a rollout from step ``k`` (> 0) as if steps ``0 … k−1`` had run: ``previous_x0`` ``(B, ...)``,
        step ``k−1``'s clean prediction, is the multistep history, so step ``k`` takes the second-order update."""
        self.scheduler.set_begin_index(k)
        self.scheduler.model_outputs[-1] = previous_x0.detach().float()
        self.scheduler.lower_order_nums = 2  # the first-order warm-up is behind
        self.k = k

    def __call__(self, velocity: torch.Tensor, sample: torch.Tensor, sigma: float, sigma_next: float,
                 generator: torch.Generator | None = None, prev_sample: torch.Tensor | None = None) -> StepOutput:
        grid = self.scheduler.sigmas
        if self.k >= len(grid) - 1 or not math.isclose(float(grid[self.k]), float(sigma), rel_tol=0, abs_tol=1e-6):
            raise ValueError(f"DPM-Solver step {self.k} was called at sigma {sigma}, not at the grid's "
                             f"{float(grid[min(self.k, len(grid) - 1)])}: build one DPMSolverSteps per rollout")
        t = self.scheduler.timesteps[self.k]
        x_next = self.scheduler.step(velocity.float(), t, sample.float(), return_dict=False)[0].float()
        self.k += 1
        nan = torch.full((x_next.shape[0],), float("nan"), device=x_next.device)
        return StepOutput(x_next, nan, x_next, torch.zeros((x_next.shape[0],) + (1,) * (x_next.ndim - 1),
                                                           device=x_next.device))
