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


#: Pref-GRPO's Qwen-Image-Edit conditioning: the source resized to the output size, the VL encoder handed the VAE's
#: input tensor, the negative "" read over a black image, CFG without the norm rescale
PREF_GRPO_FORM = {"edit_image_size": "output", "vl_image": "vae_tensor", "negative_image": "black",
                  "negative_prompt": "", "cfg_rescale": False}


def test_pref_grpo_conditioning_and_guided_velocity_equal_the_authors(tiny_model_dir):
    """Known answers from Pref-GRPO @ 3e787f6's own functions (``_prepare_condition_latents``, ``grpo_one_step``,
    their embedding script's ``encode_prompt`` lines) on the twin with an 8× VAE (their code assumes 8×)."""
    import json
    from pathlib import Path

    import numpy as np
    from PIL import Image

    known = json.loads((Path(__file__).parent / "known_answers" / "pref_grpo_qwen_image_edit.json").read_text())
    folder = tiny_model_dir("qwen_image_edit", **known["tiny_overrides"])
    size = {"height": known["height"], "width": known["width"], "max_sequence_length": known["max_sequence_length"]}
    policy = pipelines.load(folder, defaults={**size, **PREF_GRPO_FORM})
    w, h = known["source"]["size_wh"]
    source = Image.fromarray((np.random.RandomState(known["source"]["seed"]).rand(h, w, 3) * 255).astype(np.uint8))
    cond = policy.encode([known["instruction"]], images=[source])

    def rows(embeds, mask):  # the unpadded rows, as their per-sample embeddings
        return embeds[0][mask[0].bool()].float()

    z = torch.tensor(known["condition_latents"]["values"]).view(known["condition_latents"]["shape"])
    torch.testing.assert_close(cond.tensors["image_latents"], z, rtol=1e-5, atol=1e-5)
    for ours, name in ((rows(cond.tensors["prompt_embeds"], cond.tensors["prompt_embeds_mask"]), "prompt_embeds"),
                       (rows(cond.tensors["negative_prompt_embeds"], cond.tensors["negative_prompt_embeds_mask"]),
                        "negative_prompt_embeds")):
        theirs = known[name]
        assert list(ours.shape) == theirs["shape"], name
        torch.testing.assert_close(ours.norm(dim=-1), torch.tensor(theirs["row_norms"]), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(ours[:, :4].flatten(), torch.tensor(theirs["first_columns"]), rtol=1e-4, atol=1e-4)
    g = torch.Generator().manual_seed(known["latents_seed"])
    x = torch.randn(1, *z.shape[1:], generator=g)
    sigma = known["grid"]["model_timestep"][0] / 1000  # their transformer reads int(1000·σ) / 1000
    with torch.no_grad():
        for scale, theirs in known["guided"].items():
            v = policy.velocity(x, sigma, cond, float(scale))
            torch.testing.assert_close(v.flatten(), torch.tensor(theirs["velocity"]), rtol=1e-4, atol=1e-4)


def test_the_pipelines_conditioning_is_not_the_pref_grpo_form(tiny_model_dir):
    """Each of the four switches changes what the model is given; a value of neither form is refused."""
    import numpy as np
    from PIL import Image

    folder = tiny_model_dir("qwen_image_edit")
    source = Image.fromarray((np.random.RandomState(0).rand(24, 64, 3) * 255).astype(np.uint8))  # 64 wide
    x = torch.randn(1, 16, 16, generator=torch.Generator().manual_seed(0))
    authors = pipelines.load(folder, defaults=PREF_GRPO_FORM)
    with torch.no_grad():
        base = authors.velocity(x, 0.5, authors.encode(PROMPTS[:1], images=[source]), 4.0)
        for key, pipeline_form in (("edit_image_size", "area"), ("vl_image", "image"),
                                   ("negative_image", "source"), ("cfg_rescale", True)):
            other = pipelines.load(folder, defaults={**PREF_GRPO_FORM, key: pipeline_form})
            cond = other.encode(PROMPTS[:1], images=[source])
            if key == "edit_image_size":  # at the 32² area the wide source keeps its aspect (64 × 32 px)
                assert cond.tensors["image_hw"].tolist() == [[8, 16]]
                continue
            assert not torch.allclose(other.velocity(x, 0.5, cond, 4.0), base, atol=1e-6), key
    with pytest.raises(UserError, match=r"model.defaults.vl_image='pixels': give one of image, vae_tensor"):
        pipelines.load(folder, defaults={"vl_image": "pixels"})
    with pytest.raises(UserError, match=r"model.defaults.cfg_rescale='no': give one of true, false"):
        pipelines.load(folder, defaults={"cfg_rescale": "no"})
