"""The rollout loop and SDE windows."""

import pytest
import torch

from flowalign.errors import UserError
from flowalign.sampling import random_window_start, rollout, sde_step_mask

from .gaussian_policy import GaussianPolicy


def test_rollout_shapes_and_masks():
    policy = GaussianPolicy(dim=5)
    out = rollout(policy, ["a", "b"], num_steps=6, sampler="flow_grpo", sde_window=(1, 2),
                  generator=torch.Generator().manual_seed(0), metadata=[{"i": 0}, {"i": 1}])
    assert out.latents.shape == (2, 7, 5) and out.log_probs.shape == (2, 6)
    assert out.sde_mask.tolist() == [False, True, True, False, False, False]
    assert torch.isnan(out.log_probs[:, ~out.sde_mask]).all()
    assert torch.isfinite(out.log_probs[:, out.sde_mask]).all()
    assert out.sigmas[0] == 1 and out.sigmas[-1] == 0
    sub = out.select([1])
    assert sub.prompts == ["b"] and sub.metadata == [{"i": 1}] and torch.equal(sub.latents[0], out.latents[1])


def test_ode_steps_inside_a_window_are_deterministic():
    policy = GaussianPolicy(dim=3)
    noise = torch.randn(4, 3, generator=torch.Generator().manual_seed(1))
    a = rollout(policy, ["p"] * 4, num_steps=6, sampler="flow_grpo", sde_window=(2, 1), initial_noise=noise,
                generator=torch.Generator().manual_seed(5))
    b = rollout(policy, ["p"] * 4, num_steps=6, sampler="flow_grpo", sde_window=(2, 1), initial_noise=noise,
                generator=torch.Generator().manual_seed(6))
    assert torch.equal(a.latents[:, :3], b.latents[:, :3])  # ODE prefix shared: branching is valid
    assert not torch.equal(a.latents[:, 3], b.latents[:, 3])


def test_last_step_is_never_stochastic():
    assert sde_step_mask(5).tolist() == [True, True, True, True, False]
    with pytest.raises(ValueError):
        sde_step_mask(5, (3, 2))


def test_random_window_in_range_and_seeded():
    starts = {random_window_start(10, 2, torch.Generator().manual_seed(s)) for s in range(50)}
    assert starts <= set(range(0, 4)) and len(starts) > 1
    g1, g2 = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    assert random_window_start(10, 3, g1) == random_window_start(10, 3, g2)


@pytest.mark.parametrize("prompts", ["a prompt", [1, 2], []])
def test_bad_prompts_are_user_errors(prompts):
    with pytest.raises(UserError, match="prompt"):
        rollout(GaussianPolicy(), prompts, num_steps=2)


def test_noise_level_out_of_range_and_unknown_sampler():
    with pytest.raises(UserError, match="out of range"):
        rollout(GaussianPolicy(), ["a"], num_steps=2, sampler="cps", noise_level=1.5)
    with pytest.raises(UserError, match="unknown sampler"):
        rollout(GaussianPolicy(), ["a"], num_steps=2, sampler="ddim")
