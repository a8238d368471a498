"""Qwen-Image-Edit on its tiny twin: the instruction read with the image by the VL encoder, the image's latents
as context tokens, agreement with ``QwenImageEditPipeline`` (its 1024² condition area shrunk to the twin's 32²)."""

from __future__ import annotations

import pytest
import torch
from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit

import pipelines
from flowalign.errors import UserError
from tests.pipelines import family_checks as checks

PROMPTS = checks.EDIT_PROMPTS
inputs = checks.edit_inputs


@pytest.fixture(scope="module")
def folder(tiny_model_dir):
    return tiny_model_dir("qwen_image_edit")


@pytest.fixture(scope="module")
def policy(folder):
    return pipelines.load(folder)


def test_image_conditions_text_and_tokens(policy):
    assert policy.family == "qwen_image_edit" and policy.input_images
    cond = policy.encode(PROMPTS, images=inputs())
    assert cond.tensors["image_latents"].shape == (2, 16, 16) and cond.tensors["image_hw"].tolist() == [[8, 8]] * 2
    swapped = policy.encode(PROMPTS, images=inputs()[::-1])
    # the VL encoder sees the image: the same instruction reads differently over another image
    assert not torch.equal(cond.tensors["prompt_embeds"][0], swapped.tensors["prompt_embeds"][0])
    x = policy.initial_noise(2, torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert not torch.allclose(policy.velocity(x, 0.5, cond, 4.0), policy.velocity(x, 0.5, swapped, 4.0))
    with pytest.raises(UserError, match="input image"):
        policy.encode(PROMPTS)


def test_ode_rollout_reproduces_the_diffusers_pipeline(policy, monkeypatch):
    # the pipeline conditions at a fixed 1024² area; the twin's flowalign.json sets edit_image_area = 32²
    area = policy.defaults["edit_image_area"]
    real = pipeline_qwenimage_edit.calculate_dimensions
    monkeypatch.setattr(pipeline_qwenimage_edit, "calculate_dimensions", lambda _, ratio: real(area, ratio))
    x1 = policy.initial_noise(1, torch.Generator().manual_seed(7))
    steps, w = 2, 4.0
    image = inputs()[0]
    ours = checks.ode(policy, x1, policy.encode(PROMPTS[:1], images=[image]), policy.sigmas(steps), w)
    with torch.no_grad():
        theirs = policy.pipe(image=image, prompt=PROMPTS[:1], negative_prompt=[" "], true_cfg_scale=w, height=32,
                             width=32, num_inference_steps=steps, max_sequence_length=64, latents=x1.clone(),
                             output_type="latent").images
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
