"""FLUX policy on the tiny FLUX.1-dev-like model: packed latents, dynamic-shift grid, guidance embedding,
agreement with ``FluxPipeline``."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from diffusers.pipelines.flux.pipeline_flux import calculate_shift

import pipelines
from flowalign.errors import UserError
from flowalign.protocols import FlowPolicy
from tests.pipelines.family_checks import PROMPTS, check_rollout_reproduces_pipeline, ode


@pytest.fixture(scope="module")
def policy(tiny_flux_dir):
    return pipelines.load(tiny_flux_dir)


def test_end_to_end_shapes_dtypes_range(policy):
    assert isinstance(policy, FlowPolicy)
    assert policy.family == "flux" and not policy.is_video and policy.guidance_embeds
    cond = policy.encode(PROMPTS)
    assert set(cond.tensors) == {"prompt_embeds", "pooled_prompt_embeds"}, "FLUX-dev has no CFG negatives"
    x = policy.initial_noise(2, torch.Generator().manual_seed(0))
    # 32×32 pixels, VAE factor 4 → 8×8 latents of 4 channels → 4×4 tokens of 2×2×4 = 16 values
    assert x.shape == (2, *policy.latent_shape) == (2, 16, 16) and x.dtype == torch.float32
    x0 = ode(policy, x, cond, policy.sigmas(3), guidance=3.5)
    assert x0.dtype == torch.float32 and torch.isfinite(x0).all()
    with torch.no_grad():
        images = policy.decode(x0)
    assert images.shape == (2, 3, 32, 32) and images.dtype == torch.float32
    assert torch.isfinite(images).all() and images.min() >= 0 and images.max() <= 1


def test_initial_noise_is_the_pipelines_packed_noise(policy):
    ours = policy.initial_noise(2, torch.Generator().manual_seed(3))
    latents, _ = policy.pipe.prepare_latents(
        2, 4, 32, 32, torch.float32, torch.device("cpu"), torch.Generator().manual_seed(3)
    )
    assert torch.equal(ours, latents)


def test_sigmas_are_the_schedulers_own_with_dynamic_shift(policy):
    assert policy.scheduler.config.use_dynamic_shifting
    for n in (1, 4, 10):
        grid = policy.sigmas(n)
        ref = copy.deepcopy(policy.pipe.scheduler)
        # the FluxPipeline call: base sigmas linspace(1, 1/n, n), mu from the image token count
        ref.set_timesteps(sigmas=np.linspace(1.0, 1 / n, n), mu=calculate_shift(16, 256, 4096, 0.5, 1.15))
        assert grid.shape == (n + 1,) and grid.dtype == torch.float32
        assert torch.equal(grid, ref.sigmas.float())
        assert grid[0] == 1 and grid[-1] == 0 and (grid.diff() < 0).all()


def test_transformer_output_is_the_velocity_of_the_convention(policy):
    cond = policy.encode(PROMPTS)
    x = policy.initial_noise(2, torch.Generator().manual_seed(1))
    grid = policy.sigmas(4)
    scheduler = copy.deepcopy(policy.scheduler)  # set by sigmas(4)
    with torch.no_grad():
        v = policy.velocity(x, grid[0], cond, 3.5)
    stepped = scheduler.step(v, scheduler.timesteps[0], x, return_dict=False)[0]
    torch.testing.assert_close(stepped, x + (grid[1] - grid[0]) * v, rtol=0, atol=1e-6)


def test_guidance_goes_through_the_embedding(policy):
    cond = policy.encode(PROMPTS)
    x = policy.initial_noise(2, torch.Generator().manual_seed(2))
    calls = []
    hook = policy.transformer.register_forward_hook(lambda m, args, kw, out: calls.append(kw), with_kwargs=True)
    try:
        with torch.no_grad():
            v_low = policy.velocity(x, 0.6, cond, 1.0)
            v_high = policy.velocity(x, 0.6, cond, 5.0)
    finally:
        hook.remove()
    assert len(calls) == 2, "one forward per velocity: no CFG batch"
    assert calls[1]["hidden_states"].shape[0] == 2
    assert torch.equal(calls[1]["guidance"], torch.full((2,), 5.0))
    assert not torch.allclose(v_low, v_high)


def test_ode_rollout_reproduces_the_diffusers_pipeline(policy):
    x1 = policy.initial_noise(2, torch.Generator().manual_seed(7))
    steps, w = 4, 3.5
    ours = ode(policy, x1, policy.encode(PROMPTS), policy.sigmas(steps), w)
    check_rollout_reproduces_pipeline(policy, x1, ours, prompt=PROMPTS, height=32, width=32,
                                      num_inference_steps=steps, guidance_scale=w,
                                      max_sequence_length=policy.defaults["max_sequence_length"])


def test_encode_caches_per_prompt(policy):
    calls = []
    hook = policy.pipe.text_encoder_2.register_forward_hook(lambda *a: calls.append(1))
    try:
        fresh = ["one hexagon above a star"]
        first = policy.encode(fresh)
        second = policy.encode(fresh)
    finally:
        hook.remove()
    assert len(calls) == 1
    for k in first.tensors:
        assert torch.equal(first.tensors[k], second.tensors[k])


def test_schnell_style_model_takes_no_guidance(tiny_model_dir):
    folder = tiny_model_dir(
        "flux", transformer={"guidance_embeds": False}, scheduler={"use_dynamic_shifting": False, "shift": 1.0}
    )
    schnell = pipelines.load(folder, defaults={"guidance_scale": 0.0})
    assert not schnell.guidance_embeds
    cond = schnell.encode(PROMPTS[:1])
    x = schnell.initial_noise(1)
    with torch.no_grad():
        v = schnell.velocity(x, 1.0, cond, 0.0)
    assert v.shape == x.shape and torch.isfinite(v).all()
    with pytest.raises(UserError, match="guidance"):
        schnell.velocity(x, 1.0, cond, 3.5)
    ref = copy.deepcopy(schnell.pipe.scheduler)
    ref.set_timesteps(sigmas=np.linspace(1.0, 0.25, 4))
    assert torch.equal(schnell.sigmas(4), ref.sigmas.float())
