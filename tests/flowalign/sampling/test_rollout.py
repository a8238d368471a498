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


def test_rollouts_drawn_alike_join_in_order_and_others_are_refused():
    """``Rollout.cat`` of selections gives the selected samples in order (a micro-batch re-formed from rollout
    batches); parts with other SDE steps are refused."""
    policy = GaussianPolicy(dim=3)
    out = rollout(policy, ["a", "b", "c"], num_steps=4, sampler="flow_grpo",
                  generator=torch.Generator().manual_seed(0), metadata=[{"i": 0}, {"i": 1}, {"i": 2}])
    joined = type(out).cat([out.select([2]), out.select([0, 1])])
    again = out.select([2, 0, 1])
    assert joined.prompts == ["c", "a", "b"] and joined.metadata == [{"i": 2}, {"i": 0}, {"i": 1}]
    assert torch.equal(joined.latents, again.latents) and torch.equal(joined.samples, again.samples)
    torch.testing.assert_close(joined.log_probs, again.log_probs, rtol=0, atol=0, equal_nan=True)
    assert len(joined.cond) == 3 and torch.equal(joined.sde_mask, out.sde_mask)
    other = rollout(policy, ["d"], num_steps=4, sampler="flow_grpo", sde_window=(1, 1),
                    generator=torch.Generator().manual_seed(1))
    with pytest.raises(ValueError, match="drawn differently"):
        type(out).cat([out, other])


def test_a_single_sample_is_the_selection_of_it_as_views_of_the_batch():
    """``Rollout.single(j)`` holds what ``select([j])`` holds, its tensors views of the batch's (no copy)."""
    policy = GaussianPolicy(dim=3)
    out = rollout(policy, ["a", "b", "c"], num_steps=4, sampler="flow_grpo", keep_velocities=True,
                  generator=torch.Generator().manual_seed(0), metadata=[{"i": 0}, {"i": 1}, {"i": 2}])
    one, copy = out.single(1), out.select([1])
    assert one.prompts == copy.prompts == ["b"] and one.metadata == copy.metadata == [{"i": 1}]
    for name in ("latents", "samples", "velocities"):
        view, copied = getattr(one, name), getattr(copy, name)
        assert torch.equal(view, copied) and view.untyped_storage().data_ptr() == getattr(out, name).untyped_storage().data_ptr()
    torch.testing.assert_close(one.log_probs, copy.log_probs, rtol=0, atol=0, equal_nan=True)
    assert len(one.cond) == 1 and torch.equal(one.sde_mask, out.sde_mask)


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


def test_a_rollout_from_an_ode_prefix_is_the_whole_rollout_from_its_start():
    """``prefix``: the states x_T … x_k of an ODE path; the rollout from x_k with the same generator is the
    rollout from x_T (equal latents and log-probs, NaN on the prefix's steps), and a prefix over a stochastic
    step, one of another batch size or with keep_velocities is refused in one line."""
    policy = GaussianPolicy(dim=3)
    noise = torch.randn(2, 3, generator=torch.Generator().manual_seed(1))
    whole = rollout(policy, ["p", "q"], num_steps=6, sampler="flow_grpo", sde_window=(3, 1), initial_noise=noise,
                    generator=torch.Generator().manual_seed(5))
    path = rollout(policy, ["p", "q"], num_steps=6, sampler="ode", initial_noise=noise).latents
    part = rollout(policy, ["p", "q"], num_steps=6, sampler="flow_grpo", sde_window=(3, 1), prefix=path[:, :4],
                   generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(part.latents, whole.latents)
    torch.testing.assert_close(part.log_probs, whole.log_probs, equal_nan=True)
    assert part.sde_mask.tolist() == whole.sde_mask.tolist() and torch.isnan(part.log_probs[:, :3]).all()
    with pytest.raises(UserError, match=r"prefix: its 4 steps are ODE steps, but the rollout's steps \[3\]"):
        rollout(policy, ["p", "q"], num_steps=6, sde_window=(3, 1), prefix=path[:, :5])
    with pytest.raises(UserError, match=r"prefix: shape \(1, 4, 3\); give \(samples=2"):
        rollout(policy, ["p", "q"], num_steps=6, sde_window=(3, 1), prefix=path[:1, :4])
    with pytest.raises(UserError, match="prefix: keep_velocities"):
        rollout(policy, ["p", "q"], num_steps=6, sde_window=(3, 1), prefix=path[:, :4], keep_velocities=True)
