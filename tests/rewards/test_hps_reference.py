"""``hps`` against the hpsv2 package's ``score()`` (known answers).

hpsv2 1.2.0's ``img_score.score`` was run on the tiny open_clip model of ``conftest.py`` (``tiny_open_clip``: seed 0,
``TINY_OPEN_CLIP``), loaded strictly into their bundled open_clip's ``CLIP``: only names and paths mapped
(``'ViT-H-14'`` to the tiny config, the checkpoint to the tiny state dict) and their tokenizer's context length set to
the tiny text tower's 32. Their scores are kept in ``known_answers/hps_reference.json`` (provenance inside); each
test feeds the same images and prompts to flowalign's ``hps``.

Their ``preprocess_val`` (``light_augmentation=True``) converts the PIL image to floats first (``ToTensor``), then
resizes the longest side to the model's size (bicubic, antialiased, on the float tensor), zero-pads to a square and
normalises with OpenAI's mean and std; the score is the dot product of the unit-norm features. On a square image that
is flowalign's resize (shortest side) and centre crop, with no 8-bit rounding on either side: the same torch kernels
on the same floats, so 1e-5 (seen: 1.4e-7). Bilinear resampling, no antialiasing, 0.5 or ImageNet mean/std, a resize
past the crop (72 then a 64 crop), squashing to 60 and padding, ``exp(logit_scale)`` times the cosine, or a text
embedding off unit norm by 1 % each move some square batch by 7.7e-4 or more (77× the tolerance).

On a non-square image their scorer pads where CLIP's preprocessing crops: ``hps`` pads too (``resize: pad``, its
default), so the landscape batch scores as theirs; ``resize: crop``, the former form, scores it otherwise.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import rewards
from flowalign.errors import UserError
from rewards.tiny_rewards import TINY_OPEN_CLIP
from tests.rewards.known_images import known_batch

ANSWERS = json.loads((Path(__file__).parent / "known_answers" / "hps_reference.json").read_text())
SQUARE = ["square96", "square40"]
#: see the module docstring
TOLERANCE = 1e-5


def theirs(name: str) -> torch.Tensor:
    return torch.tensor(ANSWERS["batches"][name]["scores"])


@pytest.fixture(scope="module")
def hps(tiny_clip_spec):
    return rewards.load("hps", model=tiny_clip_spec)


@pytest.mark.parametrize("name", SQUARE)
def test_hps_equals_hpsv2s_score_on_square_images(hps, name):
    x, prompts = known_batch(ANSWERS["batches"][name])
    torch.testing.assert_close(hps(x, prompts, []).components["hps"], theirs(name), atol=TOLERANCE, rtol=0)


def letterbox(x: torch.Tensor, size: int) -> torch.Tensor:
    """Their ``ResizeMaxSize``, written out: the longest side to ``size`` (rounded), bicubic antialiased, zeros
    around."""
    h, w = x.shape[-2:]
    nh, nw = (round(d * size / max(h, w)) for d in (h, w))
    x = F.interpolate(x, size=(nh, nw), mode="bicubic", align_corners=False, antialias=True)
    ph, pw = size - nh, size - nw
    return F.pad(x, (pw // 2, pw - pw // 2, ph // 2, ph - ph // 2))


def test_on_a_non_square_image_hps_pads_as_hpsv2_and_the_former_crop_does_not(hps, tiny_clip_spec):
    """The landscape batch: ``hps`` (``resize: pad``) scores it as theirs, and as the batch letterboxed by hand first
    (then a square at the model's size, which nothing resizes); ``resize: crop`` (CLIP's centre crop, the former
    form) scores it otherwise; a bad ``resize`` is one line naming it."""
    x, prompts = known_batch(ANSWERS["batches"]["landscape"])
    torch.testing.assert_close(hps(x, prompts, []).components["hps"], theirs("landscape"), atol=TOLERANCE, rtol=0)
    padded = letterbox(x, TINY_OPEN_CLIP["vision_cfg"]["image_size"])
    torch.testing.assert_close(hps(padded, prompts, []).components["hps"], theirs("landscape"), atol=TOLERANCE, rtol=0)
    cropped = rewards.load("hps", model=tiny_clip_spec, resize="crop")
    assert (cropped(x, prompts, []).components["hps"] - theirs("landscape")).abs().max() > 1000 * TOLERANCE
    with pytest.raises(UserError, match="hps reward: resize='letterbox' is not known; use one of model, crop, pad"):
        rewards.load("hps", model=tiny_clip_spec, resize="letterbox")
