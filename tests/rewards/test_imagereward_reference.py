"""``imagereward`` against the ImageReward package's model as Flow-GRPO's ``ImageRewardScorer`` drives it (known answers).

Their model class builds BLIP's ViT-L at 224 px and a 768-input head whatever the checkpoint holds, so it was run
once at the released widths with two layers: the folder below (``save_tiny_imagereward(widths="released",
layers=2)``) loaded into it, only the downloads redirected to the folder and create_vit's ViT-L depth passed as 2
(its text encoder's depth is the folder's ``med_config.json``). Their scores and token ids are kept in
``known_answers/imagereward_reference.json`` (provenance inside); each test feeds the same images to flowalign.

Tolerances. The ``exact`` batch is 224 × 224, which neither side resizes or crops: both compute on the same
tensors, so 1e-5 (seen: 7e-7). The others are resized: their scorer hands PIL 8-bit images, and PIL's bicubic
resize rounds to 8 bits and clips after each of its two separable passes (≤ 1 level of 255 a pixel, ~0.5 % of
pixels a level apart even when those passes are emulated in float); flowalign resizes the floats. That moved
these scores by at most 2.8e-4 (scores ~0.4, 0.1 apart between images): 5e-4. Bilinear resampling, no
antialiasing, the crop's other offset, squashing instead of cropping, ImageNet's or 0.5 mean/std, the head's mean
or std (even 1.03 for 1.0333), a token length of 32 or 40, or a ReLU in the head each move some batch by 9× its
tolerance or more.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import rewards
from rewards.imagereward import MAX_TOKENS, save_tiny_imagereward
from tests.rewards.known_images import known_batch

ANSWERS = json.loads((Path(__file__).parent / "known_answers" / "imagereward_reference.json").read_text())
EXACT, RESIZED = 1e-5, 5e-4


def batch(name: str) -> tuple[torch.Tensor, list[str]]:
    return known_batch(ANSWERS["batches"][name])


@pytest.fixture(scope="module")
def reward(tmp_path_factory: pytest.TempPathFactory):
    folder = save_tiny_imagereward(tmp_path_factory.mktemp("imagereward") / "released", seed=0, widths="released")
    return rewards.load("imagereward", path=str(folder))


@pytest.mark.parametrize("name", sorted(ANSWERS["batches"]))
def test_imagereward_equals_the_imagereward_package_as_flow_grpo_scores(reward, name):
    x, prompts = batch(name)
    theirs = torch.tensor(ANSWERS["batches"][name]["scores"])
    ours = reward(x, prompts, []).components["imagereward"]
    tolerance = EXACT if name == "exact" else RESIZED
    torch.testing.assert_close(ours, theirs, atol=tolerance, rtol=0, msg=lambda m: f"imagereward {name}: {m}")


def test_pixels_pil_equals_the_imagereward_package_where_it_resizes_too(tmp_path_factory):
    """``pixels: pil`` hands the model what their scorer hands it (8-bit PIL images through the package's
    torchvision transform): every batch within the exact batch's tolerance, resized or not; no gradient."""
    folder = save_tiny_imagereward(tmp_path_factory.mktemp("imagereward-pil") / "released", seed=0, widths="released")
    reward = rewards.load("imagereward", path=str(folder), pixels="pil")
    assert reward.differentiable is False
    for name in sorted(ANSWERS["batches"]):
        x, prompts = batch(name)
        theirs = torch.tensor(ANSWERS["batches"][name]["scores"])
        torch.testing.assert_close(reward(x, prompts, []).components["imagereward"], theirs, atol=EXACT, rtol=0,
                                   msg=lambda m: f"imagereward pixels: pil {name}: {m}")


def test_the_prompts_tokenise_as_their_blip_tokenizer(reward):
    """bert-base-uncased's WordPiece (here the folder's vocabulary) plus [DEC] and [ENC], padded or cut to 35; the
    long prompt is cut, so a token length other than 35 changes its ids (and its score)."""
    for prompt, ids in ANSWERS["input_ids"].items():
        ours = reward.tokenizer(prompt, padding="max_length", truncation=True, max_length=MAX_TOKENS)["input_ids"]
        assert ours == ids, prompt
    assert any(ids[-1] != 0 for ids in ANSWERS["input_ids"].values())  # a prompt filling all 35


def test_save_tiny_imagereward_names_an_unknown_size(tmp_path):
    from flowalign.errors import UserError

    with pytest.raises(UserError, match=r"widths='huge' is not known; use one of tiny, released"):
        save_tiny_imagereward(tmp_path / "x", widths="huge")
