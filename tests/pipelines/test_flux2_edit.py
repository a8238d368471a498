"""FLUX.2 reference-image editing on the tiny klein twin: references prepared, encoded and placed as
``Flux2KleinPipeline(image=...)`` does, rollouts equal to the pipeline's own call on the same noise and
references, rollouts reading ``metadata["image"]``, the planner's reference tokens, and the encoding of target
images."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import pipelines
from flowalign.errors import UserError
from flowalign.sampling import rollout
from pipelines.flux2 import transformer_inputs
from tests.pipelines import family_checks as checks

PROMPTS = checks.EDIT_PROMPTS
references = checks.reference_images


@pytest.fixture(scope="module")
def folder(tiny_model_dir):
    return tiny_model_dir("flux2", sampling={"reference_images": 1})


@pytest.fixture(scope="module")
def policy(folder):
    return pipelines.load(folder)


def test_references_enter_the_conditioning(policy):
    assert policy.family == "flux2" and policy.input_images
    cond = policy.encode(PROMPTS, images=references())
    # a 64 px reference at f=4 in 2×2 patches: 8×8 tokens of 4·4 channels, ids (10, row, column, 0)
    assert cond.tensors["image_latents"].shape == (2, 64, 16)
    ids = cond.tensors["image_ids"]
    assert ids.shape == (2, 64, 4) and set(ids[..., 0].unique().tolist()) == {10}
    assert ids[0, 9].tolist() == [10, 1, 1, 0] and ids[0, -1].tolist() == [10, 7, 7, 0]
    x = policy.initial_noise(2, torch.Generator().manual_seed(0))
    swapped = policy.encode(PROMPTS, images=references()[::-1])
    with torch.no_grad():
        assert not torch.allclose(policy.velocity(x, 0.5, cond, 4.0), policy.velocity(x, 0.5, swapped, 4.0))
    with pytest.raises(UserError, match="reference images per prompt"):
        policy.encode(PROMPTS)


def test_two_references_per_prompt(tiny_model_dir):
    """Two references: the second's time axis is 20 and its tokens follow the first's."""
    policy = pipelines.load(tiny_model_dir("flux2", sampling={"reference_images": 2}))
    red, green = references()
    cond = policy.encode(PROMPTS, images=[[red, green], [green, red]])
    ids = cond.tensors["image_ids"]
    assert cond.tensors["image_latents"].shape == (2, 128, 16)
    assert ids[0, :64, 0].eq(10).all() and ids[0, 64:, 0].eq(20).all()
    torch.testing.assert_close(cond.tensors["image_latents"][0, :64], cond.tensors["image_latents"][1, 64:])
    with pytest.raises(UserError, match="reference_images"):
        policy.encode(PROMPTS, images=references())


def test_ode_rollout_reproduces_the_diffusers_pipeline(policy):
    """The same noise and reference through our Euler loop and ``Flux2KleinPipeline(image=...)``, CFG 4."""
    x1 = policy.initial_noise(1, torch.Generator().manual_seed(7))
    steps, w = 3, 4.0
    # a 72×80 reference: the pipeline floors its sides to multiples of 2·f = 8 and centre-crops, as we do
    reference = references(80)[0].crop((0, 4, 80, 76))
    ours = checks.ode(policy, x1, policy.encode(PROMPTS[:1], images=[reference]), policy.sigmas(steps), w)
    h, wt = policy.token_hw
    start = x1.permute(0, 2, 1).reshape(1, -1, h, wt)
    with torch.no_grad():
        theirs = policy.pipe(prompt=PROMPTS[:1], image=[reference], guidance_scale=w, height=32, width=32,
                             num_inference_steps=steps, max_sequence_length=32, text_encoder_out_layers=(1, 2, 3),
                             latents=start, output_type="latent").images
        plain = policy.pipe(prompt=PROMPTS[:1], guidance_scale=w, height=32, width=32, num_inference_steps=steps,
                            max_sequence_length=32, text_encoder_out_layers=(1, 2, 3), latents=start,
                            output_type="latent").images
    torch.testing.assert_close(policy.to_vae_latents(ours), theirs, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(theirs, plain, atol=1e-3), "the reference must change the pipeline's result"


def test_rollout_takes_the_references_from_metadata(policy):
    r = rollout(policy, PROMPTS, num_steps=2, sampler="ode", metadata=[{"image": im} for im in references()],
                generator=torch.Generator().manual_seed(1))
    direct = policy.encode(PROMPTS, images=references())
    assert torch.equal(r.cond.tensors["image_latents"], direct.tensors["image_latents"])
    with pytest.raises(UserError, match="has none"):
        rollout(policy, PROMPTS, num_steps=2, metadata=[{}, {}])


def test_text_to_image_folder_takes_no_metadata_images(tiny_model_dir):
    policy = pipelines.load(tiny_model_dir("flux2"))
    assert not policy.input_images
    with pytest.raises(UserError, match="take none"):
        rollout(policy, PROMPTS, num_steps=1, metadata=[{"image": im} for im in references()])


def test_planner_counts_the_reference_tokens(policy):
    config = policy.transformer.config
    size = {"height": 512, "width": 512, "max_sequence_length": 512}
    plain = transformer_inputs(config, 2, size)
    edit = transformer_inputs(config, 2, {**size, "reference_images": 2})
    assert plain["hidden_states"].shape[1] == 32 * 32 and edit["hidden_states"].shape[1] == 3 * 32 * 32
    assert edit["img_ids"].shape[1] == edit["hidden_states"].shape[1]


def test_target_images_encode_to_the_tokens_decode_inverts(policy):
    """``encode_images`` (supervised fine-tuning's x0) is the pipeline's reference encoding at the output size,
    in the noise's token layout."""
    image = references(32)[0]
    pixels = torch.from_numpy(np.asarray(image, dtype=np.float32) / 255.0).permute(2, 0, 1)
    x0 = policy.encode_images(pixels[None])
    tokens, _ = policy.encode_references([image])
    assert x0.shape == (1, *policy.latent_shape)
    torch.testing.assert_close(x0, tokens, rtol=1e-5, atol=1e-5)  # the processor normalises in its own float order
    with pytest.raises(UserError, match="output size"):
        policy.encode_images(pixels[None, :, :16])
