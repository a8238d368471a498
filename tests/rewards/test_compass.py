"""The compass / compass_fr rewards: fidelity to the LR input, perceptual gain over its upscale, and the
input-quality-adaptive trade-off between them (properties that fail when the measure is wrong)."""

import pytest
import torch
from PIL import ImageFilter

import rewards
from flowalign.errors import UserError
from flowalign.sampling.inputs import load_input_image
from rewards.compass import Compass, CompassFR, fidelity_weight, input_quality, resize
from rewards.sr import HR_SIZE, Degradation, degrade, load_split, render_hr

SIZE = (HR_SIZE, HR_SIZE)


@pytest.fixture(scope="module")
def scenes():
    return [render_hr(t) for t in load_split("medium", "test", n=4)]


def _t(image):
    return load_input_image(image)


def _score(reward, x, lr, tasks=None):
    meta = [{"image": y, **({"task": t.to_dict()} if tasks else {})} for y, t in zip(lr, tasks or lr)]
    out = reward(x, [""] * len(x), meta)
    return out.components[reward.name], out.info


def test_identity_upscale_of_a_clean_lr_keeps_fidelity_and_gains_nothing(scenes):
    lr = [_t(degrade(s, Degradation(2))) for s in scenes]
    up = torch.cat([resize(y[None], SIZE) for y in lr])
    sharp = torch.stack([_t(s) for s in scenes])
    _, info = _score(Compass(), up, lr)
    _, info_sharp = _score(Compass(), sharp, lr)
    for a, b in zip(info, info_sharp):
        assert a["fidelity"] > 0.95 and abs(a["gain"]) < 1e-4  # nothing gained over the upscale itself
        assert b["gain"] > 0.5 > a["gain"]  # the true HR is sharper than the upscale


def test_a_blurred_output_gains_less_and_scores_lower(scenes):
    lr = [_t(degrade(s, Degradation(2, blur=0.8, noise=0.02, seed=i))) for i, s in enumerate(scenes)]
    sharp = torch.stack([_t(s) for s in scenes])
    blurred = torch.stack([_t(s.filter(ImageFilter.GaussianBlur(1.5))) for s in scenes])
    score_sharp, info_sharp = _score(Compass(), sharp, lr)
    score_blur, info_blur = _score(Compass(), blurred, lr)
    assert all(b["gain"] < a["gain"] for a, b in zip(info_sharp, info_blur))
    assert (score_blur < score_sharp).all()


def test_input_quality_falls_with_blur_and_noise_and_the_fidelity_weight_follows(scenes):
    for scene in scenes:
        blur = [input_quality(_t(degrade(scene, Degradation(2, blur=b)))[None]).item() for b in (0.0, 1.0, 2.0)]
        noise = [input_quality(_t(degrade(scene, Degradation(2, noise=n, seed=1)))[None]).item()
                 for n in (0.0, 0.03, 0.08)]
        assert blur[0] > blur[1] > blur[2] and noise[0] > noise[1] > noise[2]
    q = torch.linspace(0, 1, 11)
    w = fidelity_weight(q, 0.3, 0.9)
    assert (w.diff() > 0).all() and w[0] == pytest.approx(0.3) and w[-1] == pytest.approx(0.9)


def test_a_poor_input_weighs_gain_more_than_a_clean_one(scenes):
    clean = [_t(degrade(s, Degradation(2))) for s in scenes]
    poor = [_t(degrade(s, Degradation(2, blur=2.0, noise=0.06, seed=3))) for s in scenes]
    sharp = torch.stack([_t(s) for s in scenes])
    _, info_clean = _score(Compass(), sharp, clean)
    _, info_poor = _score(Compass(), sharp, poor)
    assert all(p["fidelity_weight"] < c["fidelity_weight"] for c, p in zip(info_clean, info_poor))


def test_full_reference_variant_prefers_the_hr_image():
    tasks = load_split("hard", "test", n=4)
    lr = [_t(degrade(render_hr(t), t.degradation)) for t in tasks]
    up = torch.cat([resize(y[None], SIZE) for y in lr])
    hr = torch.stack([_t(render_hr(t)) for t in tasks])
    wrong = hr.roll(1, 0)  # a sharp image of another scene: gain without fidelity
    s_up, info_up = _score(CompassFR(), up, lr, tasks)
    s_hr, info_hr = _score(CompassFR(), hr, lr, tasks)
    s_wrong, _ = _score(CompassFR(), wrong, lr, tasks)
    assert (s_hr > s_up).all() and (s_hr > s_wrong).all()
    assert all(h["psnr"] == pytest.approx(100.0) and h["ssim"] > 0.999 for h in info_hr)
    assert all(u["psnr"] < 40 for u in info_up)


def test_registered_with_bounded_options_and_a_quality_model_by_name(scenes):
    assert {"compass", "compass_fr"} <= set(rewards.available())
    with pytest.raises(UserError, match="fidelity_weight_low"):
        rewards.load("compass", fidelity_weight_low=0.95, fidelity_weight_high=0.5)
    with pytest.raises(UserError, match="needs the LR input"):
        rewards.load("compass")(torch.rand(1, 3, 16, 16), [""], [{}])
    # a quality model in place of the Laplacian energy: the brightness reward ranks a brighter output higher
    lr = [_t(degrade(scenes[0], Degradation(2)))]
    up = resize(lr[0][None], SIZE)
    reward = rewards.load("compass", quality_model="brightness")
    (_, info_bright), (_, info_dark) = _score(reward, (up + 0.2).clamp(0, 1), lr), _score(reward, up * 0.6, lr)
    assert info_bright[0]["gain"] > 0 > info_dark[0]["gain"]
