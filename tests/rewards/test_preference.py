"""Preference rewards: ``pickscore`` (tiny transformers CLIPModel folder) and ``hps`` (tiny open_clip)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import rewards
from flowalign.errors import UserError
from rewards.preference import HPSScore, PickScore

PROMPTS = ["a red circle", "two blue squares", "a red circle", "a green star on white"]


@pytest.fixture(scope="module")
def pickscore(tiny_pickscore_dir) -> PickScore:
    return rewards.load("pickscore", path=str(tiny_pickscore_dir), form="logit")


def test_pickscore_equals_scaled_cosine_of_the_in_memory_models_features(tiny_pickscore, pickscore, images):
    """By hand with the model as built before saving (so loading round-trips); 64 px needs no resize.
    ``form: logit`` is the paper's score ``exp(logit_scale)·cos``."""
    model, tok = tiny_pickscore
    x = images(4)
    mean = torch.tensor([0.48145466, 0.4578275, 0.40821073])[:, None, None]
    std = torch.tensor([0.26862954, 0.26130258, 0.27577711])[:, None, None]
    with torch.no_grad():
        img = model.get_image_features(pixel_values=(x - mean) / std).pooler_output
        inputs = tok(PROMPTS, padding=True, return_tensors="pt")  # PickScore's own padding
        txt = model.get_text_features(**inputs).pooler_output
    expected = model.logit_scale.exp() * (F.normalize(img, dim=-1) * F.normalize(txt, dim=-1)).sum(-1)
    out = pickscore(x, PROMPTS, [])
    assert pickscore.name == "pickscore" and pickscore.differentiable is True
    assert out.components["pickscore"].shape == (4,) and out.components["pickscore"].dtype == torch.float32
    torch.testing.assert_close(out.components["pickscore"], expected, atol=1e-4, rtol=1e-5)


def test_pickscore_batching_bf16_and_gradient(tiny_pickscore_dir, pickscore, images):
    x = images(8, seed=1)
    prompts = PROMPTS * 2
    ref = pickscore(x, prompts, []).components["pickscore"]
    small = PickScore(str(tiny_pickscore_dir), form="logit", batch_size=2)(x, prompts, [])
    torch.testing.assert_close(small.components["pickscore"], ref, atol=1e-5, rtol=0)
    assert torch.equal(pickscore(x, prompts, []).components["pickscore"], ref)  # deterministic
    bf16 = PickScore(str(tiny_pickscore_dir), form="logit", dtype="bf16")(x, prompts, [])
    # scores are logit-scaled (x ~14 here): compare on the cosine scale
    scale = pickscore.model.logit_scale.exp().item()
    torch.testing.assert_close(bf16.components["pickscore"] / scale, ref / scale, atol=0.03, rtol=0)
    xg = images(2, size=80).requires_grad_(True)
    pickscore(xg, PROMPTS[:2], []).total.sum().backward()
    assert torch.isfinite(xg.grad).all() and xg.grad.abs().sum() > 0


def test_pickscore_random_init_and_missing_folders(tmp_path, tiny_pickscore_dir, pickscore, images):
    x = images(2, seed=2)
    random = PickScore(str(tiny_pickscore_dir), form="logit", random_init=True)
    assert not torch.allclose(random(x, PROMPTS[:2], []).total, pickscore(x, PROMPTS[:2], []).total)
    with pytest.raises(UserError, match=r"path='.*nothing' does not exist; download yuvalkirstain/PickScore_v1"):
        PickScore(path=str(tmp_path / "nothing"))
    with pytest.raises(UserError, match=r"has no CLIP tokenizer files.*give processor_path"):
        PickScore(path=str(tiny_pickscore_dir), processor_path=str(tmp_path))


def test_hps_is_clip_score_with_hps_weights(tiny_clip_spec, images):
    hps = rewards.load("hps", model=tiny_clip_spec)
    clip = rewards.load("clip_score", model=tiny_clip_spec)
    assert isinstance(hps, HPSScore) and hps.name == "hps" and hps.differentiable
    x = images(3, seed=3)
    out = hps(x, PROMPTS[:3], [])
    assert set(out.components) == {"hps"}
    torch.testing.assert_close(out.components["hps"], clip(x, PROMPTS[:3], []).components["clip_score"])


def test_hps_needs_its_checkpoint():
    with pytest.raises(UserError, match=r"hps reward: path is not set; download HPS_v2.1_compressed.pt \(xswu/HPSv2\)"):
        HPSScore()
    with pytest.raises(UserError, match="does not exist; download HPS_v2.1"):
        HPSScore(path="/no/HPS_v2.1_compressed.pt")
    with pytest.raises(UserError, match="no such file; give HPS_v2.1"):  # the deprecated option still checks
        HPSScore(pretrained="/no/HPS_v2.1_compressed.pt")


FAV_PROMPTS = json.loads((Path(__file__).parent / "known_answers" / "fav_hps_prompts.json").read_text())


def test_prompt_form_reads_the_prompt_as_favs_hpsv2_scorer(tiny_clip_spec, images):
    """``prompt_form: photo_of_first_clause`` gives the text encoder what FAV's HPSv2 reward gives its own (their
    ``build_labels`` on fixed prompts): scores equal those of the plain reward on the wrapped prompts."""
    wrapped = rewards.load("hps", model=tiny_clip_spec, prompt_form="photo_of_first_clause")
    plain = rewards.load("hps", model=tiny_clip_spec)
    prompts = [c["prompt"] for c in FAV_PROMPTS["cases"]]
    texts = [c["text"] for c in FAV_PROMPTS["cases"]]
    x = images(len(prompts), seed=5)
    got = wrapped(x, prompts, []).components["hps"]
    torch.testing.assert_close(got, plain(x, texts, []).components["hps"])
    assert not torch.allclose(got, plain(x, prompts, []).components["hps"])
    with pytest.raises(UserError, match="prompt_form='photo' is not known; use one of as_given, photo_of_first_clause"):
        rewards.load("hps", model=tiny_clip_spec, prompt_form="photo")


def test_bilinear_interpolation_resamples_as_favs_hpsv2_scorer(tiny_open_clip, tiny_clip_spec, images):
    """``interpolation: bilinear`` resamples as FAV's HPSv2 scorer (their ``encode_images``: torchvision's
    ``Resize(size, antialias=True)``, bilinear by default, no crop, then CLIP's mean and std): scores equal the
    tiny model run on torchvision's transform; the default (the model's bicubic) gives other scores."""
    from torchvision import transforms

    size = tiny_open_clip.visual.image_size
    size = size[0] if isinstance(size, (tuple, list)) else size
    fav_preprocess = transforms.Compose([
        transforms.Resize(size, antialias=True),
        transforms.Normalize(mean=[0.48145466, 0.4578275, 0.40821073], std=[0.26862954, 0.26130258, 0.27577711]),
    ])
    x = images(3, size=3 * size + 5, seed=7)  # downsampled by a non-integer factor: the kernels differ
    with torch.no_grad():
        img = F.normalize(tiny_open_clip.encode_image(fav_preprocess(x)), dim=-1)
        txt = F.normalize(tiny_open_clip.encode_text(rewards.load("hps", model=tiny_clip_spec).clip.tokenizer(
            PROMPTS[:3])), dim=-1)
    expected = (img * txt).sum(-1)
    got = rewards.load("hps", model=tiny_clip_spec, interpolation="bilinear")(x, PROMPTS[:3], []).components["hps"]
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    bicubic = rewards.load("hps", model=tiny_clip_spec)(x, PROMPTS[:3], []).components["hps"]
    assert (bicubic - expected).abs().max() > 1e-4
    with pytest.raises(UserError, match="interpolation='nearest' is not known; use one of model, bicubic, bilinear"):
        rewards.load("hps", model=tiny_clip_spec, interpolation="nearest")
