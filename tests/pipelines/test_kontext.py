"""FLUX.1 Kontext (editing) on its tiny twin: the input image as context tokens, agreement with
``FluxKontextPipeline`` given the same image and noise, and rollouts reading the image from their metadata."""

from __future__ import annotations

import pytest
import torch

import pipelines
from flowalign.errors import UserError
from flowalign.sampling import rollout
from flowalign.sampling.inputs import load_input_image
from tests.pipelines import family_checks as checks

PROMPTS = checks.EDIT_PROMPTS
inputs = checks.edit_inputs


@pytest.fixture(scope="module")
def folder(tiny_model_dir):
    return tiny_model_dir("kontext")


@pytest.fixture(scope="module")
def policy(folder):
    return pipelines.load(folder)


def test_image_enters_the_conditioning(policy):
    assert policy.family == "kontext" and policy.input_images and policy.defaults["guidance_scale"] == 2.5
    cond = policy.encode(PROMPTS, images=inputs())
    assert cond.tensors["image_latents"].shape == (2, 16, 16)
    assert not torch.equal(cond.tensors["image_latents"][0], cond.tensors["image_latents"][1])
    x = policy.initial_noise(2, torch.Generator().manual_seed(0))
    other = policy.encode(PROMPTS, images=inputs()[::-1])
    with torch.no_grad():
        assert not torch.allclose(policy.velocity(x, 0.5, cond, 2.5), policy.velocity(x, 0.5, other, 2.5))
    assert len(cond[[1, 1, 0]]) == 3 and torch.equal(cond[[1]].tensors["image_latents"], cond.tensors["image_latents"][1:])
    with pytest.raises(UserError, match="input image"):
        policy.encode(PROMPTS)


def test_ode_rollout_reproduces_the_diffusers_pipeline(policy):
    x1 = policy.initial_noise(2, torch.Generator().manual_seed(7))
    steps, w = 3, 2.5
    ours = checks.ode(policy, x1, policy.encode(PROMPTS, images=inputs()), policy.sigmas(steps), w)
    kwargs = dict(image=inputs(), prompt=PROMPTS, height=32, width=32, num_inference_steps=steps, guidance_scale=w,
                  max_sequence_length=32, _auto_resize=False, max_area=32 * 32)
    with torch.no_grad():
        theirs = policy.pipe(**kwargs, latents=x1.clone(), output_type="latent").images
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_rollout_takes_the_image_from_metadata(policy):
    r = rollout(policy, PROMPTS, num_steps=2, sampler="ode", metadata=[{"image": im} for im in inputs()],
                generator=torch.Generator().manual_seed(1))
    direct = policy.encode(PROMPTS, images=[load_input_image(im) for im in inputs()])
    assert torch.equal(r.cond.tensors["image_latents"], direct.tensors["image_latents"])
    with pytest.raises(UserError, match="has none"):
        rollout(policy, PROMPTS, num_steps=2, metadata=[{}, {}])
