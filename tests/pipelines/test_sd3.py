"""SD3 policy on the tiny SD3 model: shapes, the scheduler's grid, CFG, and agreement with the pipeline."""

from __future__ import annotations

import copy

import pytest
import torch

import pipelines
from flowalign.errors import UserError
from flowalign.protocols import FlowPolicy
from tests.pipelines.family_checks import (PROMPTS, check_cfg_is_the_manual_combination,
                                           check_rollout_reproduces_pipeline,
                                           check_velocity_with_a_given_uncond, ode)


@pytest.fixture(scope="module")
def policy(tiny_sd3_dir):
    return pipelines.load(tiny_sd3_dir)


def test_end_to_end_shapes_dtypes_range(policy):
    assert isinstance(policy, FlowPolicy)
    assert policy.family == "sd3" and not policy.is_video
    cond = policy.encode(PROMPTS)
    assert set(cond.tensors) == {
        "prompt_embeds", "pooled_prompt_embeds", "negative_prompt_embeds", "negative_pooled_prompt_embeds"
    }
    assert all(t.shape[0] == 2 for t in cond.tensors.values())
    x = policy.initial_noise(2, torch.Generator().manual_seed(0))
    # tiny SD3: 4 latent channels, VAE factor 4, 32×32 pixels from flowalign.json
    assert x.shape == (2, *policy.latent_shape) == (2, 4, 8, 8) and x.dtype == torch.float32
    grid = policy.sigmas(3)
    x0 = ode(policy, x, cond, grid, guidance=policy.defaults["guidance_scale"])
    assert x0.dtype == torch.float32 and torch.isfinite(x0).all()
    with torch.no_grad():
        images = policy.decode(x0)
    assert images.shape == (2, 3, 32, 32) and images.dtype == torch.float32
    assert torch.isfinite(images).all() and images.min() >= 0 and images.max() <= 1


def test_initial_noise_follows_the_generator(policy):
    a = policy.initial_noise(2, torch.Generator().manual_seed(3))
    b = policy.initial_noise(2, torch.Generator().manual_seed(3))
    c = policy.initial_noise(2, torch.Generator().manual_seed(4))
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_sigmas_are_the_schedulers_own(policy):
    for n in (1, 4, 10):
        grid = policy.sigmas(n)
        ref = copy.deepcopy(policy.pipe.scheduler)
        ref.set_timesteps(n)
        assert grid.dtype == torch.float32 and grid.shape == (n + 1,)
        assert torch.equal(grid, ref.sigmas.float())
        assert grid[0] == 1 and grid[-1] == 0 and (grid.diff() < 0).all()
    with pytest.raises(UserError, match="num_steps"):
        policy.sigmas(0)


def test_transformer_output_is_the_velocity_of_the_convention(policy):
    """One Euler step x + (σ'-σ)·v equals the scheduler's own ``step``: the output is ε - x0."""
    cond = policy.encode(PROMPTS)
    x = policy.initial_noise(2, torch.Generator().manual_seed(1))
    scheduler = copy.deepcopy(policy.pipe.scheduler)
    scheduler.set_timesteps(4)
    grid = policy.sigmas(4)
    with torch.no_grad():
        v = policy.velocity(x, grid[0], cond, 1.0)
    stepped = scheduler.step(v, scheduler.timesteps[0], x, return_dict=False)[0]
    torch.testing.assert_close(stepped, x + (grid[1] - grid[0]) * v, rtol=0, atol=1e-6)


def test_cfg_is_the_manual_combination(policy):
    check_cfg_is_the_manual_combination(policy, 4.5)


def test_sigma_as_batch_tensor_matches_per_sample_floats(policy):
    cond = policy.encode(PROMPTS)
    x = policy.initial_noise(2, torch.Generator().manual_seed(5))
    with torch.no_grad():
        both = policy.velocity(x, torch.tensor([0.9, 0.3]), cond, 4.0)
        first = policy.velocity(x[:1], 0.9, cond[0], 4.0)
        second = policy.velocity(x[1:], 0.3, cond[1], 4.0)
    torch.testing.assert_close(both, torch.cat([first, second]), rtol=1e-5, atol=1e-5)


def test_ode_rollout_reproduces_the_diffusers_pipeline(policy):
    """The strongest check: our encode + velocity + sigmas + Euler loop + decode is ``pipe(...)``."""
    x1 = policy.initial_noise(2, torch.Generator().manual_seed(7))
    steps, w = 4, 4.0
    ours = ode(policy, x1, policy.encode(PROMPTS), policy.sigmas(steps), w)
    check_rollout_reproduces_pipeline(policy, x1, ours, prompt=PROMPTS, height=32, width=32,
                                      num_inference_steps=steps, guidance_scale=w,
                                      max_sequence_length=policy.defaults["max_sequence_length"])


def test_encode_caches_per_prompt(policy):
    policy.encode(["warm up"])  # caches "" (the CFG negative) whatever ran before
    calls = []
    hook = policy.pipe.text_encoder_3.register_forward_hook(lambda *a: calls.append(1))
    try:
        fresh = ["one hexagon above a star", "a small purple pentagon"]
        first = policy.encode(fresh)
        n_first = len(calls)
        second = policy.encode(fresh)
        assert n_first == 2, "each new prompt is encoded alone"
        assert len(calls) == n_first, "cached prompts must not reach the text encoders again"
        for k in first.tensors:
            assert torch.equal(first.tensors[k], second.tensors[k])
        mixed = policy.encode([fresh[1], "nine dots"])  # one cached, one new
        assert len(calls) == n_first + 1
        assert torch.equal(mixed.tensors["prompt_embeds"][0], first.tensors["prompt_embeds"][1])
    finally:
        hook.remove()


def test_embeddings_do_not_depend_on_the_batch(tiny_sd3_dir):
    """A prompt's embedding is a function of the string alone (bit-identical resume depends on it)."""
    a = pipelines.load(tiny_sd3_dir).encode(["a red circle", "two blue squares", "nine dots"])
    b = pipelines.load(tiny_sd3_dir).encode(["nine dots"])
    for k in b.tensors:
        assert torch.equal(a.tensors[k][2:], b.tensors[k])


def test_prompts_must_be_a_list_of_str(policy):
    with pytest.raises(UserError, match="prompts"):
        policy.encode("a red circle")
    with pytest.raises(UserError, match="prompts"):
        policy.encode(["a red circle", 3])
    with pytest.raises(UserError, match="prompts"):
        policy.encode([])


def test_cfg_without_negatives_is_a_user_error(tiny_sd3_dir):
    no_cfg = pipelines.load(tiny_sd3_dir, defaults={"guidance_scale": 1.0})
    cond = no_cfg.encode(PROMPTS[:1])
    assert set(cond.tensors) == {"prompt_embeds", "pooled_prompt_embeds"}
    x = no_cfg.initial_noise(1)
    with pytest.raises(UserError, match="guidance"):
        no_cfg.velocity(x, 0.5, cond, 4.0)


def test_velocity_with_a_given_uncond_runs_the_conditional_half_only(policy):
    check_velocity_with_a_given_uncond(policy)
