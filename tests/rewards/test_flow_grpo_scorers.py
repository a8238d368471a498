"""``pickscore``, ``aesthetic`` and ``clip_score`` against Flow-GRPO's own scorers (known answers).

Flow-GRPO's ``PickScoreScorer``, ``AestheticScorer`` and ``ClipScorer`` were run (transformers 4.40, their pin)
on the tiny folders built below, only the hub names mapped to them, on fixed 8-bit images; the inputs and
their scores are kept in ``known_answers/flow_grpo_scorers.json`` (provenance inside). Each test feeds the
same images to flowalign's reward.

Tolerances. ``clip_score``'s ``form: flow_grpo`` is float all the way on both sides (their torchvision
transforms on the float tensor), so 1e-6. PickScore's and the aesthetic scorer's processor resize through
PIL on 8-bit images, rounding to 8 bits after each of its two separable passes (≤ 0.5/255 a pixel, 0.007
after CLIP's normalisation); flowalign resizes the floats. That moved the tiny models' scores by at most
1.5e-4 (PickScore, scores ~0.1) and 4e-5 (aesthetic, ~0.01): 2.5e-4 and 1e-4 leave room for that and little
more. Resampling bilinear instead of bicubic, without antialiasing, the round crop offset in place of the
processor's floor, or another mean/std each move some batch by 2.5e-4 to 5e-3 (2.5× the tolerance or more);
the resized size rounded instead of truncated, the /26 and /30 divisors, the logit scale and the head move
them more.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import rewards
from flowalign.errors import UserError
from rewards.aesthetic import AestheticHead
from tests.rewards.known_images import known_batch
from rewards.tiny_rewards import save_tiny_hf_clip

ANSWERS = json.loads((Path(__file__).parent / "known_answers" / "flow_grpo_scorers.json").read_text())
BATCHES = sorted(ANSWERS["batches"])
#: see the module docstring
TOLERANCE = {"pickscore": 2.5e-4, "aesthetic": 1e-4, "clip_score": 1e-6}


def batch(name: str) -> tuple[torch.Tensor, list[str]]:
    """A known-answer batch as ``(B, 3, h, w)`` floats ``uint8 / 255`` (what both sides were given)."""
    return known_batch(ANSWERS["batches"][name])


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny CLIP folders (projection 32, and 768 for the aesthetic head) and the aesthetic head file."""
    root = tmp_path_factory.mktemp("flow-grpo-scorers")
    save_tiny_hf_clip(root / "clip32")
    save_tiny_hf_clip(root / "clip768", projection_dim=768)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        head = AestheticHead(768)
    with torch.no_grad():  # unit-gain layers, so the score varies with the image (nn.Linear's init shrinks it)
        for layer in head.layers:
            if isinstance(layer, torch.nn.Linear):
                layer.weight.mul_(3 ** 0.5)
    torch.save(head.state_dict(), root / "head768.pth")
    return {"clip32": root / "clip32", "clip768": root / "clip768", "head": root / "head768.pth"}


def check(reward: Any, key: str) -> None:
    for name in BATCHES:
        x, prompts = batch(name)
        theirs = torch.tensor(ANSWERS["batches"][name]["scores"][key])
        ours = reward(x, prompts, []).components[key]
        torch.testing.assert_close(ours, theirs, atol=TOLERANCE[key], rtol=0, msg=lambda m: f"{key} {name}: {m}")


def test_pickscore_equals_flow_grpos_pickscore_scorer(folders):
    """The default form (``flow_grpo``: ``exp(logit_scale)·cos / 26``, the processor's floor crop)."""
    check(rewards.load("pickscore", path=str(folders["clip32"])), "pickscore")


def test_aesthetic_equals_flow_grpos_aesthetic_scorer(folders):
    check(rewards.load("aesthetic", path=str(folders["head"]), clip_path=str(folders["clip768"])), "aesthetic")


def test_pixels_pil_equals_flow_grpos_scorers_to_float_rounding(folders):
    """``pixels: pil`` hands the model what their processor hands it (transformers' PIL backend on the 8-bit
    images): PickScore and the aesthetic score to 1e-6, where the float path needs the tolerances above; the
    reward then passes no gradient, and a trainer that needs one refuses it."""
    for reward, key in ((rewards.load("pickscore", path=str(folders["clip32"]), pixels="pil"), "pickscore"),
                        (rewards.load("aesthetic", path=str(folders["head"]), clip_path=str(folders["clip768"]),
                                      pixels="pil"), "aesthetic")):
        assert reward.differentiable is False
        for name in BATCHES:
            x, prompts = batch(name)
            theirs = torch.tensor(ANSWERS["batches"][name]["scores"][key])
            torch.testing.assert_close(reward(x, prompts, []).components[key], theirs, atol=1e-6, rtol=0)
    with pytest.raises(UserError, match=r"pixels: pil crops as the model.s own preprocessing does \(crop_offset: floor\)"):
        rewards.load("pickscore", path=str(folders["clip32"]), pixels="pil", crop_offset="round")
    with pytest.raises(UserError, match="pixels='bytes' is not known"):
        rewards.load("pickscore", path=str(folders["clip32"]), pixels="bytes")


def test_clip_score_flow_grpo_form_equals_their_clip_scorer(folders):
    """``form: flow_grpo``: ``exp(logit_scale)·cos / 30`` on images resized bilinear and cropped as torchvision."""
    check(rewards.load("clip_score", path=str(folders["clip32"]), form="flow_grpo"), "clip_score")


def test_the_earlier_forms_stay_selectable_and_differ_where_the_crop_margin_is_odd(folders):
    """The portrait batch's 27-px margin is where torchvision's round and the processor's floor part."""
    x, prompts = batch("portrait")
    theirs = torch.tensor(ANSWERS["batches"]["portrait"]["scores"]["pickscore"])
    former = rewards.load("pickscore", path=str(folders["clip32"]), crop_offset="round")(x, prompts, [])
    assert (former.components["pickscore"] - theirs).abs().max() > 4 * TOLERANCE["pickscore"]
    cosine = rewards.load("clip_score", path=str(folders["clip32"]))(x, prompts, []).components["clip_score"]
    flow_grpo = rewards.load("clip_score", path=str(folders["clip32"]), form="flow_grpo", interpolation="bicubic")
    scaled = flow_grpo(x, prompts, []).components["clip_score"]
    torch.testing.assert_close(scaled, flow_grpo.clip.model.logit_scale.exp() * cosine / 30, atol=1e-6, rtol=0)


@pytest.mark.parametrize(("name", "options", "message"), [
    ("pickscore", {"crop_offset": "centre"}, r"pickscore reward: crop_offset='centre' is not known; use one of floor"),
    ("aesthetic", {"crop_offset": 1}, r"aesthetic reward: crop_offset=1 is not known; use one of floor"),
    ("clip_score", {"crop_offset": "ceil"}, r"clip_score reward: crop_offset='ceil' is not known; use one of round"),
    ("clip_score", {"form": "logit"}, r"clip_score reward: form='logit' is not known; use one of cosine, flow_grpo"),
    ("hps", {"form": "flow_grpo"}, r"hps reward: form='flow_grpo' is not known; use one of cosine"),
])
def test_new_options_are_checked(folders, name, options, message):
    from flowalign.errors import UserError

    path = {"pickscore": folders["clip32"], "aesthetic": folders["head"]}.get(name, folders["clip32"])
    extra = {"clip_path": str(folders["clip768"])} if name == "aesthetic" else {}
    with pytest.raises(UserError, match=message):
        rewards.load(name, path=str(path), **extra, **options)
