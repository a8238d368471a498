"""Properties of the sampler steps (docs/methods/samplers.md)."""

import json
import math
from pathlib import Path

import pytest
import torch

from flowalign.sampling import cps_step, euler_step, flow_grpo_diffusion, flow_sde_step, rollout, sde_step
from flowalign.sampling.steps import gaussian_log_prob

from .gaussian_policy import GaussianPolicy


def _final_stats(sampler: str, noise_level: float, num_steps: int, n: int = 8000, seed: int = 0):
    policy = GaussianPolicy(mean=0.3, std=0.5, dim=4, shift=3.0)
    out = rollout(policy, ["p"] * n, num_steps=num_steps, sampler=sampler, noise_level=noise_level,
                  generator=torch.Generator().manual_seed(seed))
    x = out.final_latents
    return x.mean().item(), x.std().item()


@pytest.mark.parametrize("noise_level", [0.7, 1.0])
def test_flow_grpo_sde_preserves_gaussian_marginals(noise_level):
    # spec: T=100, shift 3 -> std ~0.49 for s=0.5; a drift without the score term ends near 1.09
    mean, std = _final_stats("flow_grpo", noise_level, num_steps=100)
    assert abs(mean - 0.3) < 0.03
    assert abs(std - 0.5) < 0.03


def test_flow_grpo_marginals_converge_like_the_ode():
    for sampler, level in [("ode", 0.0), ("flow_grpo", 0.7)]:
        coarse = abs(_final_stats(sampler, level, 10)[1] - 0.5)
        fine = abs(_final_stats(sampler, level, 100)[1] - 0.5)
        assert fine < coarse and fine < 0.03


def test_cps_under_disperses_at_finite_eta():
    # documented property: CPS is not marginal-preserving with posterior-mean velocities (~0.39 for s=0.5)
    _, std = _final_stats("cps", 0.8, num_steps=100)
    assert 0.3 < std < 0.45


def test_cps_noise_coefficients_square_sum_to_sigma_next():
    # with the exact velocity of a single data point, x' = (1-σ')x0 + σ'·(fresh standard noise)
    g = torch.Generator().manual_seed(1)
    n, x0, sigma, sigma_next = 200_000, 0.25, 0.8, 0.5
    eps = torch.randn(n, 1, generator=g)
    x = (1 - sigma) * x0 + sigma * eps
    v = eps - x0
    out = cps_step(v, x, sigma, sigma_next, eta=0.8, generator=g)
    resid = out.prev_sample - (1 - sigma_next) * x0
    assert abs(resid.std().item() - sigma_next) < 5e-3
    assert out.std.flatten()[0].item() == pytest.approx(sigma_next * math.sin(0.8 * math.pi / 2))


@pytest.mark.parametrize("kind,level", [("flow_grpo", 0.7), ("dance", 0.3), ("cps", 0.8)])
def test_log_prob_equals_torch_normal(kind, level):
    g = torch.Generator().manual_seed(0)
    x, v = torch.randn(3, 4, 5, 5, generator=g), torch.randn(3, 4, 5, 5, generator=g)
    sigma = torch.tensor([0.9, 0.6, 1.0])
    sigma_next = torch.tensor([0.8, 0.5, 0.9])
    out = sde_step(kind, v, x, sigma, sigma_next, noise_level=level, generator=g, cps_log_prob="gaussian")
    ref = torch.distributions.Normal(out.mean, out.std.expand_as(out.mean)).log_prob(out.prev_sample)
    torch.testing.assert_close(out.log_prob, ref.flatten(1).mean(1), rtol=1e-5, atol=1e-5)


def test_flow_grpo_diffusion_substitutes_next_sigma_at_one():
    s = flow_grpo_diffusion(torch.tensor([1.0, 0.5]), torch.tensor([0.9, 0.4]), 0.7)
    assert s[0].item() == pytest.approx(0.7 * math.sqrt(1.0 / 0.1))
    assert s[1].item() == pytest.approx(0.7 * math.sqrt(0.5 / 0.5))


def test_zero_noise_reduces_exactly_to_euler():
    g = torch.Generator().manual_seed(0)
    x, v = torch.randn(2, 8, generator=g), torch.randn(2, 8, generator=g)
    euler = euler_step(v, x, 0.7, 0.55).prev_sample
    sde = flow_sde_step(v, x, 0.7, 0.55, diffusion=0.0, generator=g).prev_sample
    assert torch.equal(sde, euler)
    torch.testing.assert_close(cps_step(v, x, 0.7, 0.55, eta=0.0, generator=g).prev_sample, euler, rtol=0, atol=1e-6)
    assert torch.equal(sde_step("flow_grpo", v, x, 0.7, 0.55, noise_level=0.0).prev_sample, euler)
    assert torch.isnan(sde_step("ode", v, x, 0.7, 0.55, noise_level=0.7).log_prob).all()


@pytest.mark.parametrize("kind", ["flow_grpo", "cps", "dance"])
def test_reevaluating_a_stored_transition_gives_ratio_one(kind):
    policy = GaussianPolicy(dim=6)
    out = rollout(policy, ["a", "b", "c"], num_steps=8, sampler=kind, generator=torch.Generator().manual_seed(3))
    assert out.trained_steps() == list(range(7))
    for k in out.trained_steps():
        x_k, x_next, stored = out.step(k)
        v = policy.velocity(x_k, out.sigmas[k].item(), out.cond, 1.0)
        again = sde_step(kind, v, x_k, out.sigmas[k].item(), out.sigmas[k + 1].item(),
                         noise_level=out.noise_level, prev_sample=x_next)
        assert torch.equal(again.log_prob, stored)
        assert torch.exp(again.log_prob - stored).eq(1).all()


def test_sigma_as_batch_tensor_matches_float():
    g = torch.Generator().manual_seed(0)
    x, v = torch.randn(2, 3, generator=g), torch.randn(2, 3, generator=g)
    a = sde_step("flow_grpo", v, x, 0.5, 0.4, noise_level=0.7, generator=torch.Generator().manual_seed(9))
    b = sde_step("flow_grpo", v, x, torch.tensor([0.5, 0.5]), torch.tensor([0.4, 0.4]), noise_level=0.7,
                 generator=torch.Generator().manual_seed(9))
    assert torch.equal(a.prev_sample, b.prev_sample) and torch.equal(a.log_prob, b.log_prob)


def test_log_prob_is_a_per_element_mean():
    x = torch.zeros(1, 10)
    mean, std = torch.zeros(1, 10), torch.ones(1, 1)
    assert gaussian_log_prob(x, mean, std).item() == pytest.approx(-0.5 * math.log(2 * math.pi))


def test_bad_kind_and_negative_noise():
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="unknown sampler kind"):
        sde_step("ddpm", x, x, 0.5, 0.4, noise_level=0.5)
    with pytest.raises(ValueError, match="noise_level"):
        sde_step("flow_grpo", x, x, 0.5, 0.4, noise_level=-1)


#: UMM-Reflection's flow transition (waltstephen/UMM-Reflection @ 8510796, third_party/flow_grpo/flow_grpo/bagel/
#: modeling/bagel/bagel.py: g022_sde_denominator and Bagel._sde_step_with_logprob, sde_type "sde") on fixed float64
#: tensors, with their clamp "r3_t_ge_0p95" and their former "exact_t_equals_one_sigma_max", η 1.0 and 0.7
FLOORED = json.loads((Path(__file__).parent / "known_answers" / "floored_flow_sde_step.json").read_text())


@pytest.mark.parametrize("case", FLOORED["cases"], ids=lambda c: f"{c['mode']}-eta{c['eta']}-s{c['sigma']:.3f}")
def test_floored_flow_sde_step_equals_umm_reflection_transition(case):
    """Mean, std and log-prob of ``flow_grpo_floored`` equal theirs under their clamp; their former clamp (the grid's
    next σ substituted at σ = 1 only) is ``flow_grpo``'s noise scale, which differs from the floored one above 0.95."""
    x, v, x_next = (torch.tensor(case[k], dtype=torch.float64) for k in ("sample", "velocity", "next_sample"))
    kind = "flow_grpo_floored" if case["mode"] == "r3_t_ge_0p95" else "flow_grpo"
    out = sde_step(kind, v, x, case["sigma"], case["sigma_next"], noise_level=case["eta"], prev_sample=x_next)
    torch.testing.assert_close(out.mean.double(), torch.tensor(case["mean"], dtype=torch.float64), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out.std.flatten()[0].double(), torch.tensor(case["transition_std"], dtype=torch.float64),
                               rtol=1e-6, atol=0)
    if kind == "flow_grpo_floored":
        torch.testing.assert_close(out.log_prob.double(), torch.tensor(case["log_prob"], dtype=torch.float64),
                                   rtol=1e-6, atol=1e-6)
    else:  # flowalign's flow_grpo keeps the Gaussian's normalising terms: only −(x'−μ)²/(2τ²) is theirs
        quadratic = out.log_prob + torch.log(out.std.flatten()[0]) + 0.5 * math.log(2 * math.pi)
        torch.testing.assert_close(quadratic.double(), torch.tensor(case["log_prob"], dtype=torch.float64),
                                   rtol=1e-5, atol=1e-5)
    floored = sde_step("flow_grpo_floored", v, x, case["sigma"], case["sigma_next"], noise_level=case["eta"],
                       prev_sample=x_next)
    assert torch.equal(floored.std, out.std) == (kind == "flow_grpo_floored" or not case["sigma"] >= 0.95)
