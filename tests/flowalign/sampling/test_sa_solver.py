"""SA-Solver rollouts (flowalign/sampling/sa_solver.py) against AWM's authors' sampler.

Known answers (``known_answers/sa_solver_awm.json``, its ``about`` says how they were made): their
``SASolver.sample`` on a toy velocity in float64, with the noises it drew listed, for AWM's GenEval setting
(14 steps, τ 0.4), its PickScore one (τ 0), a strong τ = 1 on 6 steps and the shortest grid (2 steps).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from flowalign.errors import UserError
from flowalign.sampling import rollout
from flowalign.sampling.sa_solver import SASolver, SASolverSteps

from .test_ode_solvers import ToyPolicy

KNOWN = json.loads((Path(__file__).parent / "known_answers" / "sa_solver_awm.json").read_text())
C0 = torch.tensor(KNOWN["c0"], dtype=torch.float64)


def toy_velocity(x: torch.Tensor, t: float) -> torch.Tensor:
    return C0 - (0.5 + 0.4 * t) * x


@pytest.mark.parametrize("name", list(KNOWN["cases"]))
def test_every_state_equals_the_awm_authors_sa_solver(name):
    """The grid, which steps draw noise, the corrected state after every step and the final sample, with
    the noises they drew placed as the rollout places per-sample noise (a step called twice)."""
    case = KNOWN["cases"][name]
    solver = SASolver(case["noise_level"])
    grid = solver.sigmas(lambda n: torch.tensor(case["policy_sigmas"]), case["num_steps"])
    assert grid.tolist() == case["sigmas"]
    t = grid.tolist()
    steps = SASolverSteps(grid, solver, keep_corrected=True)
    stochastic = solver.stochastic_steps(grid)
    x = torch.tensor(KNOWN["z"], dtype=torch.float64)
    for k in range(case["num_steps"]):
        v = toy_velocity(x, t[k])
        out = steps(v, x, t[k], t[k + 1], None, x)
        if stochastic[k]:
            x_next = out.mean + out.std * torch.tensor(case["noises"][k + 1], dtype=torch.float64)
            out = steps(v, x, t[k], t[k + 1], None, x_next)
            assert torch.isfinite(out.log_prob).all()
        else:
            assert (out.std == 0).all() and torch.isnan(out.log_prob).all()
        x = out.prev_sample
    states = torch.tensor(case["states"], dtype=torch.float64)
    for k in range(1, case["num_steps"]):
        torch.testing.assert_close(steps.corrected[k], states[k], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(x, torch.tensor(case["final"], dtype=torch.float64), rtol=1e-12, atol=1e-12)


def test_noise_falls_on_the_steps_that_end_inside_the_window():
    grid = torch.tensor(KNOWN["cases"]["geneval_14"]["sigmas"])
    mask = SASolver(0.4).stochastic_steps(grid)
    assert mask.tolist() == [0.3 <= float(t) <= 0.9 for t in grid[1:-1]] + [False]
    assert not SASolver(0.0).stochastic_steps(grid).any()


def test_a_rollout_draws_each_samples_noise_from_its_own_stream():
    """Through :func:`rollout`: the stochastic steps are its SDE steps with log-probs; a sample's trajectory
    does not depend on the batch it is rolled out in; τ = 0 is deterministic and differs from τ = 0.4."""
    case = KNOWN["cases"]["geneval_14"]
    z = torch.tensor(KNOWN["z"], dtype=torch.float64)

    def run(solver, index):
        policy = ToyPolicy(C0[index], torch.tensor(case["policy_sigmas"]))  # the toy's c0 is per sample
        gens = [torch.Generator().manual_seed(10 + i) for i in index]
        return rollout(policy, ["a"] * len(index), num_steps=14, sampler=solver, initial_noise=z[index],
                       generators=gens, decode=False)

    both, second = run(SASolver(0.4), [0, 1]), run(SASolver(0.4), [1])
    assert both.sampler == "sa_solver" and both.noise_level == 0.4
    assert torch.equal(both.sde_mask, SASolver(0.4).stochastic_steps(both.sigmas))
    assert torch.isfinite(both.log_probs[:, both.sde_mask]).all()
    assert torch.isnan(both.log_probs[:, ~both.sde_mask]).all()
    torch.testing.assert_close(both.latents[1:], second.latents, rtol=0, atol=0)
    ode, ode_again = run(SASolver(0.0), [0, 1]), run(SASolver(0.0), [0, 1])
    assert torch.equal(ode.latents, ode_again.latents) and not ode.sde_mask.any()
    assert (ode.latents[:, -1] - both.latents[:, -1]).abs().max() > 1e-2


def test_its_ode_is_closer_to_the_exact_flow_than_euler_on_the_same_grid():
    """A second-order multistep method: on a smooth toy flow, 10 steps of it land nearer the endpoint of a
    1000-step Euler reference from the same start than 10 Euler steps do."""
    solver = SASolver(0.0)
    fine = torch.linspace(solver.sigmas(lambda n: torch.linspace(1, 0, n + 1), 10)[0].item(), 0, 1001).double()
    x0 = torch.tensor(KNOWN["z"], dtype=torch.float64)
    exact = x0.clone()
    for k in range(1000):
        exact = exact + (fine[k + 1] - fine[k]) * toy_velocity(exact, float(fine[k]))
    grid = solver.sigmas(lambda n: torch.linspace(1, 0, n + 1) ** 1.5, 10).double()
    t = grid.tolist()
    steps, sa, euler = SASolverSteps(grid, solver), x0.clone(), x0.clone()
    for k in range(10):
        sa = steps(toy_velocity(sa, t[k]), sa, t[k], t[k + 1]).prev_sample
        euler = euler + (t[k + 1] - t[k]) * toy_velocity(euler, t[k])
    assert (sa - exact).abs().max() < 0.5 * (euler - exact).abs().max()


def test_bad_settings_and_steps_off_the_grid_are_refused():
    with pytest.raises(UserError, match="num_steps >= 2"):
        SASolver().sigmas(lambda n: torch.linspace(1, 0, n + 1), 1)
    with pytest.raises(UserError, match="noise_level must be in"):
        SASolver(-0.1)
    with pytest.raises(UserError, match="window must be"):
        SASolver(0.4, (0.9, 0.3))
    steps = SASolverSteps(torch.tensor([0.999, 0.5, 0.25, 0.0]), SASolver())
    with pytest.raises(ValueError, match="one SASolverSteps per rollout"):
        steps(torch.zeros(1, 2), torch.zeros(1, 2), 0.7, 0.25)
