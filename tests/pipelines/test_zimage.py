"""Z-Image policy on its tiny twin: single-stream list inputs, the (1 - σ, x0 - ε) convention translated,
CFG scale mapped to the pipeline's, agreement with ``ZImagePipeline``."""

from __future__ import annotations

import copy

import pytest
import torch

import pipelines
from flowalign.protocols import Conditioning, FlowPolicy
from tests.pipelines import family_checks as checks

PROMPTS = checks.PROMPTS


@pytest.fixture(scope="module")
def folder(tiny_model_dir):
    return tiny_model_dir("zimage")


@pytest.fixture(scope="module")
def policy(folder):
    return pipelines.load(folder)


def test_family_detection_shapes_and_decode(policy):
    assert isinstance(policy, FlowPolicy) and policy.family == "zimage" and not policy.is_video
    cond = policy.encode(PROMPTS)
    lengths = cond.tensors["prompt_embeds_mask"].sum(1)
    assert lengths[0] != lengths[1] and cond.tensors["prompt_embeds"].shape[1] == 32
    x = policy.initial_noise(2, torch.Generator().manual_seed(0))
    assert x.shape == (2, 4, 8, 8)
    with torch.no_grad():
        images = policy.decode(checks.ode(policy, x, cond, policy.sigmas(2), 4.0))
    assert images.shape == (2, 3, 32, 32) and images.min() >= 0 and images.max() <= 1


def test_velocity_is_the_negated_output_at_one_minus_sigma(policy):
    """The transformer predicts x0 - ε at t = 1 - σ; the policy's velocity is ε - x0 at σ."""
    cond = policy.encode(PROMPTS[:1])
    x = policy.initial_noise(1, torch.Generator().manual_seed(4))
    emb = cond.tensors["prompt_embeds"][0, : int(cond.tensors["prompt_embeds_mask"].sum())]
    with torch.no_grad():
        raw = policy.transformer([x[0][:, None]], torch.tensor([0.3]), [emb], return_dict=False)[0][0]
        v = policy.velocity(x, 0.7, cond, 1.0)
    torch.testing.assert_close(v[0], -raw[:, 0].float(), rtol=0, atol=1e-6)


def test_noise_sigmas_and_guidance_scale_mapping(policy):
    latents = policy.pipe.prepare_latents(2, 4, 32, 32, torch.float32, torch.device("cpu"),
                                          torch.Generator().manual_seed(3))
    assert torch.equal(policy.initial_noise(2, torch.Generator().manual_seed(3)), latents)
    for n in (1, 4):
        ref = copy.deepcopy(policy.pipe.scheduler)
        ref.set_timesteps(sigmas=torch.linspace(1.0, 1 / n, n).tolist())
        assert torch.equal(policy.sigmas(n), ref.sigmas.float())
    cond = policy.encode(PROMPTS)
    uncond = Conditioning({"prompt_embeds": cond.tensors["negative_prompt_embeds"],
                           "prompt_embeds_mask": cond.tensors["negative_prompt_embeds_mask"]}, ["", ""])
    x = policy.initial_noise(2, torch.Generator().manual_seed(2))
    with torch.no_grad():
        v = policy.velocity(x, 0.7, cond, 4.0)
        v_c, v_u = policy.velocity(x, 0.7, cond, 1.0), policy.velocity(x, 0.7, uncond, 1.0)
    # the pipeline's v_c + w(v_c - v_u) with w = g - 1
    torch.testing.assert_close(v, v_c + 3.0 * (v_c - v_u), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("g", [4.0, 1.0])
def test_ode_rollout_reproduces_the_diffusers_pipeline(policy, g):
    x1 = policy.initial_noise(2, torch.Generator().manual_seed(7))
    steps = 3
    ours = checks.ode(policy, x1, policy.encode(PROMPTS), policy.sigmas(steps), g)
    # the pipeline's guidance_scale is ours less one (its v_c + w(v_c - v_u))
    checks.check_rollout_reproduces_pipeline(policy, x1, ours, prompt=PROMPTS, guidance_scale=g - 1, height=32,
                                             width=32, num_inference_steps=steps, max_sequence_length=32)
