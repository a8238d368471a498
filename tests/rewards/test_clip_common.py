"""Torch CLIP preprocessing (rewards/clip_common.py) against open_clip's own PIL transforms."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from flowalign.errors import UserError
from rewards.clip_common import clip_preprocess, unique_rows

MEAN, STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)


@pytest.mark.parametrize("size", [32, 224])  # downsampling and upsampling
def test_matches_open_clip_pil_transform(images, size):
    """Shortest-side bicubic resize + centre crop + normalise, as open_clip's eval transform does it."""
    from open_clip.transform import PreprocessCfg, image_transform_v2

    x = images(1, size=128, seed=3)[..., :96, :]  # a 96x128 landscape image
    pil = Image.fromarray((x[0].permute(1, 2, 0).numpy() * 255).round().astype(np.uint8))
    reference = image_transform_v2(PreprocessCfg(size=size, mean=MEAN, std=STD), is_train=False)(pil)
    quantised = torch.from_numpy(np.array(pil)).permute(2, 0, 1)[None].float() / 255
    ours = clip_preprocess(quantised, size, MEAN, STD)[0]
    assert ours.shape == reference.shape == (3, size, size)
    # PIL resamples in 8 bits with a slightly different bicubic kernel: about a grey level apart
    pixel_error = (ours - reference).abs() * torch.tensor(STD)[:, None, None]
    assert pixel_error.mean() < 2 / 255 and pixel_error.max() < 4 / 255


def test_squash_is_differentiable_and_unknown_modes_are_refused():
    x = torch.rand(2, 3, 40, 20, requires_grad=True)
    y = clip_preprocess(x, (16, 24), MEAN, STD, resize_mode="squash")
    assert y.shape == (2, 3, 16, 24)
    y.sum().backward()
    assert torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0
    with pytest.raises(UserError, match="resize_mode='longest'"):
        clip_preprocess(x, 16, MEAN, STD, resize_mode="longest")


def test_unique_rows():
    distinct, rows = unique_rows(["b", "a", "b", "c", "a"])
    assert distinct == ["b", "a", "c"] and rows.tolist() == [0, 1, 0, 2, 1]
