"""Wan 2.2 image-to-video (I2V-A14B) on its tiny twin: the first frame as mask + latent channels, agreement
with ``WanImageToVideoPipeline``."""

from __future__ import annotations

import pytest
import torch

import pipelines
from flowalign.errors import UserError
from pipelines.wan_i2v import WanI2VPolicy
from tests.pipelines import family_checks as checks

PROMPTS = ["the ball rolls to the right", "the square moves up"]
frame = checks.first_frame


@pytest.fixture(scope="module")
def folder(tiny_model_dir):
    return tiny_model_dir("wan_i2v")


@pytest.fixture(scope="module")
def policy(folder):
    return pipelines.load(folder)


def test_first_frame_condition(policy):
    assert isinstance(policy, WanI2VPolicy) and policy.family == "wan" and policy.input_images
    assert policy.boundary == 900.0
    cond = policy.encode(PROMPTS, images=[frame(), frame()])
    condition = cond.tensors["image_condition"]
    # 2 mask channels (f_t = 2) then the 4 latent channels; the mask is 1 on the first frame's positions only
    assert condition.shape == (2, 6, 3, 8, 8)
    assert torch.equal(condition[:, :2, 0], torch.ones_like(condition[:, :2, 0]))
    assert torch.equal(condition[:, :2, 1:], torch.zeros_like(condition[:, :2, 1:]))
    with pytest.raises(UserError, match="first frame"):
        policy.encode(PROMPTS)


def test_ode_rollout_reproduces_the_diffusers_pipeline(policy):
    x1 = policy.initial_noise(2, torch.Generator().manual_seed(7))
    steps = 6
    ours = checks.ode(policy, x1, policy.encode(PROMPTS, images=[frame(), frame()]), policy.sigmas(steps), 3.5)
    with torch.no_grad():
        theirs = policy.pipe(image=frame(), prompt=PROMPTS, height=32, width=32, num_frames=5, num_inference_steps=steps,
                             guidance_scale=3.5, max_sequence_length=32, latents=x1.clone(), output_type="latent").frames
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
