"""Qwen-Image policy on its tiny twin: packed latents, VL text encoder with padding masks, true CFG with a
negative prompt and norm rescale, agreement with ``QwenImagePipeline``."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift

import pipelines
from flowalign.errors import UserError
from flowalign.protocols import FlowPolicy
from tests.pipelines import family_checks as checks

PROMPTS = checks.PROMPTS


@pytest.fixture(scope="module")
def folder(tiny_model_dir):
    return tiny_model_dir("qwen_image")


@pytest.fixture(scope="module")
def policy(folder):
    return pipelines.load(folder)


def test_family_detection_shapes_and_decode(policy):
    assert isinstance(policy, FlowPolicy) and policy.family == "qwen_image" and not policy.is_video
    assert type(policy.pipe.text_encoder).__name__ == "Qwen2_5_VLForConditionalGeneration"
    cond = policy.encode(PROMPTS)
    # padded to max_sequence_length with a mask; the negative prompt " " for true CFG
    assert set(cond.tensors) == {"prompt_embeds", "prompt_embeds_mask", "negative_prompt_embeds",
                                 "negative_prompt_embeds_mask"}
    lengths = cond.tensors["prompt_embeds_mask"].sum(1)
    assert lengths[0] != lengths[1], "prompts of different lengths keep their own lengths"
    x = policy.initial_noise(2, torch.Generator().manual_seed(0))
    assert x.shape == (2, 16, 16)  # 32² px, f=4 → 8×8 latents, 2×2 packed → 16 tokens of 4·4 values
    with torch.no_grad():
        images = policy.decode(checks.ode(policy, x, cond, policy.sigmas(2), 4.0))
    assert images.shape == (2, 3, 32, 32) and images.min() >= 0 and images.max() <= 1


@pytest.mark.filterwarnings("ignore:invalid value encountered")  # diffusers' own 0/0 on the one-step grid
def test_noise_and_sigmas_are_the_pipelines(policy):
    latents = policy.pipe.prepare_latents(2, 4, 32, 32, torch.float32, torch.device("cpu"),
                                          torch.Generator().manual_seed(3))
    assert torch.equal(policy.initial_noise(2, torch.Generator().manual_seed(3)), latents)
    config = policy.scheduler.config
    assert config.time_shift_type == "exponential" and config.shift_terminal == 0.02
    for n in (2, 4):
        ref = copy.deepcopy(policy.pipe.scheduler)
        ref.set_timesteps(sigmas=np.linspace(1.0, 1 / n, n), mu=calculate_shift(16, 256, 8192, 0.5, 0.9))
        assert torch.equal(policy.sigmas(n), ref.sigmas.float())
    with pytest.raises(UserError, match="num_steps=1"):
        policy.sigmas(1)  # diffusers' own grid is NaN there


def test_true_cfg_is_the_rescaled_combination(policy):
    cond = policy.encode(PROMPTS)
    neg = type(cond)({"prompt_embeds": cond.tensors["negative_prompt_embeds"],
                      "prompt_embeds_mask": cond.tensors["negative_prompt_embeds_mask"]}, PROMPTS)
    x = policy.initial_noise(2, torch.Generator().manual_seed(2))
    with torch.no_grad():
        v = policy.velocity(x, 0.7, cond, 4.0)
        v_c, v_n = policy.velocity(x, 0.7, cond, 1.0), policy.velocity(x, 0.7, neg, 1.0)
    guided = v_n + 4.0 * (v_c - v_n)
    expected = guided * v_c.norm(dim=-1, keepdim=True) / guided.norm(dim=-1, keepdim=True)
    torch.testing.assert_close(v, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(v.norm(dim=-1), v_c.norm(dim=-1), rtol=1e-5, atol=1e-5)


def test_ode_rollout_reproduces_the_diffusers_pipeline(policy):
    x1 = policy.initial_noise(2, torch.Generator().manual_seed(7))
    steps, w = 3, 4.0
    ours = checks.ode(policy, x1, policy.encode(PROMPTS), policy.sigmas(steps), w)
    checks.check_rollout_reproduces_pipeline(
        policy, x1, ours, prompt=PROMPTS, negative_prompt=[" "] * 2, true_cfg_scale=w, height=32, width=32,
        num_inference_steps=steps, max_sequence_length=policy.defaults["max_sequence_length"])
