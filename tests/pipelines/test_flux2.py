"""FLUX.2 policy on the tiny klein twin: Qwen3 stacked-layer text features, patchified batch-normalised
latents, empirical-mu grid, CFG (base) or none (distilled), agreement with ``Flux2KleinPipeline``, and the
FLUX.2-dev twin's Mistral text and embedded guidance."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu

import pipelines
from flowalign.errors import UserError
from flowalign.protocols import FlowPolicy
from tests.pipelines import family_checks as checks

PROMPTS = checks.PROMPTS


@pytest.fixture(scope="module")
def folder(tiny_model_dir):
    return tiny_model_dir("flux2")


@pytest.fixture(scope="module")
def policy(folder):
    return pipelines.load(folder)


def test_family_detection_shapes_and_decode(policy):
    assert isinstance(policy, FlowPolicy) and policy.family == "flux2" and policy.cfg
    assert type(policy.pipe).__name__ == "Flux2KleinPipeline"
    cond = policy.encode(PROMPTS)
    # three stacked layers of the 32-wide Qwen3 stand-in, padded to max_sequence_length
    assert cond.tensors["prompt_embeds"].shape == (2, 32, 96)
    assert set(cond.tensors) == {"prompt_embeds", "negative_prompt_embeds"}
    x = policy.initial_noise(2, torch.Generator().manual_seed(0))
    assert x.shape == (2, 16, 16)  # 32² px, f=4, 2×2 patches → 4×4 tokens of 4·4 channels
    with torch.no_grad():
        images = policy.decode(checks.ode(policy, x, cond, policy.sigmas(2), 4.0))
    assert images.shape == (2, 3, 32, 32) and images.min() >= 0 and images.max() <= 1


def test_noise_and_sigmas_are_the_pipelines(policy):
    latents, _ = policy.pipe.prepare_latents(2, 4, 32, 32, torch.float32, torch.device("cpu"),
                                             torch.Generator().manual_seed(3))
    assert torch.equal(policy.initial_noise(2, torch.Generator().manual_seed(3)), latents)
    for n in (1, 4, 28):
        ref = copy.deepcopy(policy.pipe.scheduler)
        ref.set_timesteps(sigmas=np.linspace(1.0, 1 / n, n), mu=compute_empirical_mu(16, n))
        grid = policy.sigmas(n)
        assert torch.equal(grid, ref.sigmas.float()) and grid[0] == 1 and grid[-1] == 0


def test_cfg_against_the_empty_prompt(policy):
    checks.check_cfg_is_the_manual_combination(policy, 4.0)


def test_ode_rollout_reproduces_the_diffusers_pipeline(policy):
    x1 = policy.initial_noise(2, torch.Generator().manual_seed(7))
    steps, w = 3, 4.0
    ours = checks.ode(policy, x1, policy.encode(PROMPTS), policy.sigmas(steps), w)
    h, wt = policy.token_hw
    start = x1.permute(0, 2, 1).reshape(2, -1, h, wt)  # the pipeline takes unpacked (B, 4·C, h/2, w/2) latents
    kwargs = dict(prompt=PROMPTS, guidance_scale=w, height=32, width=32, num_inference_steps=steps,
                  max_sequence_length=32, text_encoder_out_layers=(1, 2, 3))
    with torch.no_grad():
        theirs = policy.pipe(**kwargs, latents=start.clone(), output_type="latent").images
        pixels = policy.pipe(**kwargs, latents=start.clone(), output_type="pt").images
        decoded = policy.decode(ours)
        mine = policy.to_vae_latents(ours)
    torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(decoded, pixels, rtol=1e-4, atol=1e-4)


def test_distilled_klein_takes_no_guidance(tiny_model_dir):
    folder = tiny_model_dir("flux2", is_distilled=True, sampling={"guidance_scale": 1.0, "num_steps": 4})
    policy = pipelines.load(folder)
    assert policy.distilled and not policy.cfg
    cond = policy.encode(PROMPTS)
    assert set(cond.tensors) == {"prompt_embeds"}
    x = policy.initial_noise(2, torch.Generator().manual_seed(1))
    with pytest.raises(UserError, match="distilled"):
        policy.velocity(x, 0.5, cond, 3.0)
    ours = checks.ode(policy, x, cond, policy.sigmas(4), 1.0)
    h, wt = policy.token_hw
    with torch.no_grad():
        theirs = policy.pipe(prompt=PROMPTS, height=32, width=32, num_inference_steps=4, max_sequence_length=32,
                             text_encoder_out_layers=(1, 2, 3), latents=x.permute(0, 2, 1).reshape(2, -1, h, wt),
                             output_type="latent").images
    torch.testing.assert_close(policy.to_vae_latents(ours), theirs, rtol=1e-5, atol=1e-5)


def test_dev_twin_mistral_text_and_embedded_guidance_reproduce_flux2_pipeline(tiny_model_dir):
    """FLUX.2-dev's path: Mistral-3 features through the Pixtral processor's chat template, the guidance scale
    as an embedding (one forward, no negatives), and ``Flux2Pipeline``'s own packed latents."""
    policy = pipelines.load(tiny_model_dir("flux2_dev"))
    assert type(policy.pipe).__name__ == "Flux2Pipeline" and policy.guidance_embeds and not policy.cfg
    assert type(policy.pipe.text_encoder).__name__ == "Mistral3ForConditionalGeneration"
    cond = policy.encode(PROMPTS)
    assert set(cond.tensors) == {"prompt_embeds"} and cond.tensors["prompt_embeds"].shape == (2, 48, 96)
    x = policy.initial_noise(2, torch.Generator().manual_seed(2))
    calls = []
    hook = policy.transformer.register_forward_hook(lambda m, a, kw, o: calls.append(kw), with_kwargs=True)
    try:
        with torch.no_grad():
            v_low, v_high = policy.velocity(x, 0.6, cond, 2.0), policy.velocity(x, 0.6, cond, 5.0)
    finally:
        hook.remove()
    assert len(calls) == 2 and calls[1]["hidden_states"].shape[0] == 2
    assert torch.equal(calls[1]["guidance"], torch.full((2,), 5.0))
    assert not torch.allclose(v_low, v_high)
    ours = checks.ode(policy, x, cond, policy.sigmas(3), 4.0)
    h, w = policy.token_hw
    with torch.no_grad():
        theirs = policy.pipe(prompt=PROMPTS, guidance_scale=4.0, height=32, width=32, num_inference_steps=3,
                             max_sequence_length=48, text_encoder_out_layers=(1, 2, 3),
                             latents=x.permute(0, 2, 1).reshape(2, -1, h, w), output_type="latent").images
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)  # dev returns the packed tokens
