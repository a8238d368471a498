"""Deterministic rollout solvers (flowalign/sampling/ode_solvers.py) against their authors' samplers.

Known answers (``known_answers/ode_solvers_dpm2.json``) were made by running, on fixed float64 tensors with a
toy velocity linear in x that also reads the model's timestep:

- DiffusionOPSD's ``run_sampling(solver="dpm2", deterministic)`` (worldbench/DiffusionOPSD,
  ``src/diffusers_patch/solver.py``) on the SD3 scheduler's 10-step shift-3 grid, the model reading
  ``torch.full([B], σ*1000, dtype=torch.long)`` as their ``pipeline_with_logprob`` gives it (their sample kept
  in float64 there);
- DGPO's sampling loop (Luo-Yihong/DGPO @ 01ceb4b ``scripts/train_sd3_dgpo.py``): ``DPMSolverMultistepScheduler``
  with the flow settings and ``flow_shift`` 3, ``latents = scheduler.step(v, t, latents)``, the model reading
  the scheduler's int64 ``timesteps``.
"""

from __future__ import annotations

import json
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch

from flowalign.errors import UserError
from flowalign.protocols import Conditioning
from flowalign.sampling import rollout
from flowalign.sampling.ode_solvers import DPMSolverSteps, OdeSolver

KNOWN = json.loads((Path(__file__).parent / "known_answers" / "ode_solvers_dpm2.json").read_text())


class ToyTransformer(torch.nn.Module):
    """``v(x, t) = c0 − (0.5 + 0.4·t/1000)·x``: linear in x, and it reads the timestep it is given."""

    def __init__(self, c0: torch.Tensor):
        super().__init__()
        self.c0 = c0
        self.timesteps: list[float] = []

    def forward(self, *, hidden_states: torch.Tensor, timestep: torch.Tensor) -> torch.Tensor:
        self.timesteps.append(float(timestep[0]))
        t = timestep.double().view(-1, *([1] * (hidden_states.ndim - 1)))
        return self.c0 - (0.5 + 0.4 * t / 1000) * hidden_states.double()


class ToyPolicy:
    """A policy whose transformer is :class:`ToyTransformer`, fed ``timestep = 1000·σ`` (float32) as flowalign's
    pipelines feed theirs, on a fixed σ grid."""

    family, is_video = "toy", False
    device, dtype = torch.device("cpu"), torch.float64

    def __init__(self, c0: torch.Tensor, grid: torch.Tensor):
        self.transformer = ToyTransformer(c0)
        self.grid = grid
        self.defaults = {"guidance_scale": 1.0}

    def encode(self, prompts: list[str]) -> Conditioning:
        return Conditioning({"dummy": torch.zeros(len(prompts), 1)}, list(prompts))

    def initial_noise(self, n: int, generator: torch.Generator | None = None) -> torch.Tensor:
        raise AssertionError("the tests pass initial_noise")

    def velocity(self, x, sigma, cond, guidance):
        t = torch.as_tensor(sigma, dtype=torch.float32).expand(x.shape[0]) * 1000.0
        return self.transformer(hidden_states=x, timestep=t)

    def sigmas(self, num_steps: int) -> torch.Tensor:
        assert num_steps == len(self.grid) - 1
        return self.grid

    def decode(self, x0):
        return x0

    def adapter_disabled(self):
        return nullcontext()


def _run(known: dict, solver: OdeSolver) -> tuple[torch.Tensor, ToyPolicy, object]:
    z = torch.tensor(KNOWN["z"], dtype=torch.float64)
    policy = ToyPolicy(torch.tensor(KNOWN["c0"], dtype=torch.float64), torch.tensor(known["sigmas"], dtype=torch.float32))
    out = rollout(policy, ["a"] * len(z), num_steps=len(known["sigmas"]) - 1, sampler=solver, initial_noise=z,
                  decode=False)
    return z, policy, out


def test_dpm2_on_the_policy_grid_equals_diffusion_opsd_run_sampling():
    known = KNOWN["opsd"]
    _, policy, out = _run(known, OdeSolver("dpm2", timestep="truncated"))
    assert policy.transformer.timesteps == [float(t) for t in known["timesteps"]]  # int(1000σ) at every step
    assert out.sampler == "dpm2" and torch.isnan(out.log_probs).all() and not out.sde_mask.any()
    # diffusers' scheduler computes the sample in float32 (theirs too); the answer was kept in float64
    torch.testing.assert_close(out.latents.double(), torch.tensor(known["latents"], dtype=torch.float64),
                               rtol=1e-6, atol=1e-6)


def test_dpm2_on_its_flow_grid_equals_dgpo_scheduler_loop():
    known = KNOWN["dgpo"]
    solver = OdeSolver("dpm2", grid="flow_shift", flow_shift=3.0, timestep="truncated")
    assert solver.sigmas(lambda n: None, 10).tolist() == pytest.approx(known["sigmas"], abs=0)
    _, policy, out = _run(known, solver)
    assert policy.transformer.timesteps == [float(t) for t in known["timesteps"]]
    torch.testing.assert_close(out.latents.double(), torch.tensor(known["latents"], dtype=torch.float64),
                               rtol=1e-6, atol=1e-6)


def test_dpm2_is_not_euler_and_the_timestep_form_matters():
    """Both choices change the trajectory of this toy (the known answers would catch a solver that ignored them)."""
    known = KNOWN["opsd"]
    _, _, dpm = _run(known, OdeSolver("dpm2", timestep="truncated"))
    _, _, euler = _run(known, OdeSolver("euler", timestep="truncated"))
    _, _, continuous = _run(known, OdeSolver("dpm2", timestep="continuous"))
    assert (dpm.latents[:, -1] - euler.latents[:, -1]).abs().max() > 1e-3
    assert (dpm.latents[:, -1] - continuous.latents[:, -1]).abs().max() > 1e-5
    assert euler.sampler == "ode"


def test_dpm2_first_step_is_euler_and_last_step_lands_on_the_clean_prediction():
    """DPM-Solver++ of first order is DDIM, i.e. Euler in flow matching; the step to σ = 0 returns x̂0 = x − σv."""
    sigmas = torch.tensor([1.0, 0.7, 0.3, 0.0])
    steps = DPMSolverSteps(sigmas)
    x, v = torch.randn(2, 3), torch.randn(2, 3)
    x1 = steps(v, x, 1.0, 0.7).prev_sample
    torch.testing.assert_close(x1, x - 0.3 * v)
    x2 = steps(v, x1, 0.7, 0.3).prev_sample
    x3 = steps(v, x2, 0.3, 0.0).prev_sample
    torch.testing.assert_close(x3, x2 - 0.3 * v)


def test_dpm2_refuses_steps_out_of_order():
    steps = DPMSolverSteps(torch.tensor([1.0, 0.5, 0.0]))
    with pytest.raises(ValueError, match="one DPMSolverSteps per rollout"):
        steps(torch.zeros(1, 2), torch.zeros(1, 2), 0.5, 0.0)


def test_bad_solver_fields_name_the_choices():
    with pytest.raises(UserError, match="'euler' or 'dpm2'"):
        OdeSolver("heun")
    with pytest.raises(UserError, match="'continuous' or 'truncated'"):
        OdeSolver("dpm2", timestep="round")
