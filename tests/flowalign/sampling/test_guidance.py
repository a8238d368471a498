"""RGS (reward-guided sampling): the properties of ``docs/methods/latent_registers.md``.

κ = 0 reproduces the plain sampler bit for bit (on the tiny SD3, FLUX and Wan models with real latent
registers);
‖v_c − v‖ = κ‖v‖ exactly; with a linear reward the final reward rises with small κ (exact Gaussian flow).
"""

import json
from pathlib import Path

import pytest
import torch

import pipelines
from flowalign.errors import UserError
from flowalign.sampling import (
    Guidance,
    GuidedPolicy,
    guide_velocity,
    reward_gradient,
    rollout,
)
from flowalign.sampling.guidance import load_latent_reward

from .gaussian_policy import GaussianPolicy


class LinearReward:
    """``r(x) = ⟨a, x⟩`` per sample: a LatentReward whose gradient is the constant direction ``a``."""

    def __init__(self, direction: torch.Tensor):
        self.a = direction

    def score(self, x, sigma, cond):
        return (x.flatten(1) * self.a.flatten()).sum(1)


class FixedGradient:
    """``r(x) = Σ ⟨G_i, x_i⟩``: a LatentReward whose gradient is the given per-sample tensor ``G``."""

    def __init__(self, grad: torch.Tensor):
        self.grad = grad

    def score(self, x, sigma, cond):
        return (x * self.grad).flatten(1).sum(1)


def _policy_and_registers(model_dir, folder):
    from rewards.latent_registers import LatentRegisters, load_frozen_transformer

    policy = pipelines.load(model_dir)
    LatentRegisters(load_frozen_transformer(str(model_dir), model_dir), num_registers=4, head_hidden=16,
                    base_model=str(model_dir)).save(folder)
    return policy, load_latent_reward(folder)


@pytest.fixture(scope="module")
def sd3_and_registers(tiny_sd3_dir, tmp_path_factory):
    return _policy_and_registers(tiny_sd3_dir, tmp_path_factory.mktemp("lrr") / "reward")


@pytest.mark.parametrize("family", ["sd3", "flux", "wan"])
def test_zero_scale_is_bit_identical_to_plain_sampling(family, tiny_model_dir, tmp_path):
    policy, reward = _policy_and_registers(tiny_model_dir(family), tmp_path / "reward")
    prompts = ["a red circle", "a blue square"]
    for sampler in ("ode", "flow_grpo"):
        plain = rollout(policy, prompts, num_steps=4, sampler=sampler, generator=torch.Generator().manual_seed(1))
        guided = rollout(policy, prompts, num_steps=4, sampler=sampler, generator=torch.Generator().manual_seed(1),
                         guide=Guidance(reward, 0.0))
        assert torch.equal(plain.latents, guided.latents) and torch.equal(plain.samples, guided.samples)
    # and a non-zero scale does change the samples (the guide is really on the path)
    moved = rollout(policy, prompts, num_steps=4, sampler="ode", generator=torch.Generator().manual_seed(1),
                    guide=Guidance(reward, 0.2))
    ode = rollout(policy, prompts, num_steps=4, sampler="ode", generator=torch.Generator().manual_seed(1))
    assert not torch.equal(moved.latents, ode.latents)


def test_guided_velocity_moves_by_exactly_kappa_norm_v(sd3_and_registers):
    policy, reward = sd3_and_registers
    x = policy.initial_noise(3, torch.Generator().manual_seed(0))
    cond = policy.encode(["a red circle", "two stars", "a cat"])
    v = policy.velocity(x, 0.6, cond, 1.0)
    grad, score = reward_gradient(reward, x, 0.6, cond)
    assert grad.shape == x.shape and score.shape == (3,) and grad.abs().sum() > 0
    for kappa in (0.01, 0.1, 0.5):
        v_c = guide_velocity(v, grad, kappa)
        torch.testing.assert_close((v_c - v).flatten(1).norm(dim=1), kappa * v.flatten(1).norm(dim=1), rtol=1e-5, atol=0)
        # the change points along −g: first-order reward change along the step direction −v_c is positive
        cos = torch.nn.functional.cosine_similarity((v_c - v).flatten(1), -grad.flatten(1))
        torch.testing.assert_close(cos, torch.ones(3))
    assert guide_velocity(v, grad, 0.0) is v


def test_final_reward_rises_with_small_kappa_for_a_linear_reward():
    policy = GaussianPolicy(dim=6)
    direction = torch.tensor([1.0, -0.5, 0.0, 0.3, 0.0, 2.0])
    reward = LinearReward(direction)
    finals = []
    for kappa in (0.0, 0.02, 0.05, 0.1):
        out = rollout(policy, ["p"] * 64, num_steps=10, sampler="ode", generator=torch.Generator().manual_seed(0),
                      guide=Guidance(reward, kappa))
        finals.append(reward.score(out.final_latents, 0.0, None).mean().item())
    assert finals == sorted(finals) and finals[-1] > finals[0] + 1e-3, finals


def test_window_limits_the_guided_steps_and_policy_wrapper():
    policy = GaussianPolicy(dim=4)
    reward = LinearReward(torch.ones(4))
    x = torch.randn(2, 4)
    g = Guidance(reward, 0.3, window=(0.2, 0.5))
    v = policy.velocity(x, 0.8, None, 1.0)
    assert g(v, x, 0.8, None) is v  # outside the window
    assert not torch.equal(g(v, x, 0.4, None), v)
    wrapped = GuidedPolicy(policy, g)
    torch.testing.assert_close(wrapped.velocity(x, 0.4, None, 1.0), g(policy.velocity(x, 0.4, None, 1.0), x, 0.4, None))
    assert wrapped.sigmas(4).shape == (5,)  # everything else is the wrapped policy's
    with pytest.raises(UserError, match="κ"):
        Guidance(reward, -1.0)
    with pytest.raises(UserError, match="window"):
        Guidance(reward, 0.1, window=(0.6, 0.2))


KNOWN = json.loads((Path(__file__).parents[1] / "trainers" / "known_answers" / "rg_opd_target_loss.json").read_text())


@pytest.mark.parametrize("case", KNOWN["cases"], ids=lambda c: c["name"])
def test_guided_step_equals_the_authors_guided_step(case):
    """Guanys-dar/latent-reward-register guidance.py @ c22b65e: ``x + dt·v_c`` is their ``guided_step`` on the
    sampler's own step ``x + dt·v`` (one head, its gradient combined, then the gated, clipped correction), at
    the scale their σ bands give, rtol 1e-6 in float64."""
    f64 = {k: torch.tensor(v, dtype=torch.float64) for k, v in case["inputs"].items()}
    x, v = f64["x"].reshape(case["shape"]), f64["v_rollout"].reshape(case["shape"])
    grad = torch.tensor(case["outputs"]["grad"], dtype=torch.float64).reshape(case["shape"])
    dt = case["next_sigma"] - case["sigma"]
    v_c = guide_velocity(v, grad, case["scale_at_sigma"])
    expected = torch.tensor(case["outputs"]["rgs_next"], dtype=torch.float64)
    torch.testing.assert_close((x + dt * v_c).flatten(), expected, rtol=1e-6, atol=1e-12)
    # the same step from RGS with their σ bands: the band's scale is their GuidanceSchedule's at this σ
    guide = Guidance(FixedGradient(grad), bands=[tuple(b) for b in case["bands"]])
    assert guide.scale_at(case["sigma"]) == case["scale_at_sigma"]
    torch.testing.assert_close((x + dt * guide(v, x, case["sigma"], None)).flatten(), expected, rtol=1e-6, atol=1e-12)


def test_bands_are_the_authors_schedule():
    """Their SD3 preset's bands ((0.8, 0.30), (0.2, 0.05)): a step takes the scale of the first band it
    exceeds (strictly), none at or below the last; malformed bands are refused."""
    guide = Guidance(LinearReward(torch.ones(4)), bands=((0.8, 0.30), (0.2, 0.05)))
    assert [guide.scale_at(s) for s in (1.0, 0.81, 0.8, 0.5, 0.21, 0.2, 0.0)] == [0.3, 0.3, 0.05, 0.05, 0.05, 0.0, 0.0]
    x = torch.randn(2, 4)
    assert guide(x, x, 0.1, None) is x  # below the last band: plain sampling
    for bad in (((0.2, 0.05), (0.8, 0.3)), ((0.5, 0.1), (0.5, 0.2)), ((1.5, 0.1),), ((0.5, -0.1),), ()):
        with pytest.raises(UserError, match="guide bands"):
            Guidance(LinearReward(torch.ones(4)), bands=bad)
