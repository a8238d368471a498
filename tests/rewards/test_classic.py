"""Classic rewards: JPEG (in)compressibility, brightness, saturation."""

from __future__ import annotations

import pytest
import torch

import rewards
from flowalign.errors import UserError
from rewards.classic import SATURATION_EPS, jpeg_kilobytes


def _flat_and_noise() -> torch.Tensor:
    flat = torch.full((3, 64, 64), 0.5)
    noise = torch.rand(3, 64, 64, generator=torch.Generator().manual_seed(0))
    return torch.stack([flat, noise])


def test_flat_image_is_more_compressible_than_noise():
    x = _flat_and_noise()
    comp = rewards.load("jpeg_compressibility")(x, ["", ""], [])
    incomp = rewards.load("jpeg_incompressibility", quality=80)(x, ["", ""], [])
    assert comp.components["jpeg_compressibility"][0] > comp.components["jpeg_compressibility"][1]
    assert incomp.components["jpeg_incompressibility"][1] > incomp.components["jpeg_incompressibility"][0]
    torch.testing.assert_close(comp.components["jpeg_compressibility"], -jpeg_kilobytes(x, 95))
    assert comp.valid.all() and comp.components["jpeg_compressibility"].dtype == torch.float32
    # lower quality, fewer bytes for the busy image
    assert incomp.components["jpeg_incompressibility"][1] < -comp.components["jpeg_compressibility"][1]


def test_jpeg_is_not_differentiable_and_checks_its_input():
    reward = rewards.load("jpeg_compressibility")
    assert reward.differentiable is False and reward.name == "jpeg_compressibility"
    x = _flat_and_noise()
    x[1, 0, 0, 0] = float("nan")
    assert reward(x, ["", ""], []).valid.tolist() == [True, False]
    with pytest.raises(UserError, match="quality must be an integer in \\[1, 100\\]"):
        rewards.load("jpeg_incompressibility", quality=0)
    with pytest.raises(UserError, match="float in \\[0, 1\\]"):
        reward((x.nan_to_num() * 255).to(torch.uint8), ["", ""], [])


def test_brightness_and_saturation_values():
    grey, red, black = torch.full((3, 8, 8), 0.25), torch.zeros(3, 8, 8), torch.zeros(3, 8, 8)
    red[0] = 1.0
    x = torch.stack([grey, red, black])
    bright = rewards.load("brightness")(x, [""] * 3, []).components["brightness"]
    sat = rewards.load("saturation")(x, [""] * 3, []).components["saturation"]
    torch.testing.assert_close(bright, torch.tensor([0.25, 0.2126, 0.0]))
    torch.testing.assert_close(sat, torch.tensor([0.0, 1 / (1 + SATURATION_EPS), 0.0]))


def test_brightness_and_saturation_are_differentiable(images):
    for name in ("brightness", "saturation"):
        reward = rewards.load(name)
        assert reward.differentiable is True
        x = images(2).requires_grad_(True)
        reward(x, ["", ""], []).total.sum().backward()
        assert torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0, name
