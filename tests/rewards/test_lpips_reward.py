"""The ``lpips`` reward (−LPIPS to a per-sample reference) with a random AlexNet trunk."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

import rewards
from flowalign.errors import UserError
from rewards.lpips_reward import LPIPSReward


@pytest.fixture(scope="module")
def reward() -> LPIPSReward:
    torch.manual_seed(0)
    return rewards.load("lpips", random_init=True)


def _noisy(x: torch.Tensor, amount: float, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (x + amount * torch.randn(x.shape, generator=g)).clamp(0, 1)


def test_identical_is_zero_and_distance_lowers_the_score(reward, images):
    ref = images(1)[0]
    x = torch.stack([ref, _noisy(ref, 0.05), _noisy(ref, 0.3)])
    out = reward(x, [""] * 3, [{"reference": ref}] * 3)
    score = out.components["lpips"]
    assert reward.name == "lpips" and reward.differentiable is True
    assert score.shape == (3,) and score.dtype == torch.float32 and out.valid.all()
    assert abs(score[0]) < 1e-6 and 0 > score[1] > score[2]


def test_mask_restricts_the_comparison_to_the_preserved_region(reward, images):
    ref = images(1, seed=1)[0]
    edited = ref.clone()
    edited[:, :, :32] = _noisy(ref[:, :, :32], 0.3)  # the edit: left half changed
    keep_right = torch.zeros(64, 64, dtype=torch.bool)
    keep_right[:, 32:] = True
    meta = [{"reference": ref, "mask": keep_right}, {"reference": ref}, {"reference": ref, "mask": ~keep_right}]
    preserved, whole, edited_region = reward(edited.expand(3, -1, -1, -1), [""] * 3, meta).components["lpips"]
    assert preserved > whole > edited_region


def test_reference_from_file_array_or_other_size(tmp_path, reward, images):
    ref = images(1, seed=2)[0]
    pixels = (ref.permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)
    Image.fromarray(pixels).save(tmp_path / "ref.png")
    quantised = torch.from_numpy(pixels.copy()).permute(2, 0, 1).float() / 255
    x = _noisy(ref, 0.1).expand(4, -1, -1, -1)
    bigger = F.interpolate(quantised[None], size=(128, 128), mode="bilinear", align_corners=False)[0]
    meta = [{"reference": quantised}, {"reference": str(tmp_path / "ref.png")}, {"reference": pixels},
            {"reference": bigger}]
    score = reward(x, [""] * 4, meta).components["lpips"]
    torch.testing.assert_close(score[1:3], score[:1].expand(2), atol=1e-6, rtol=0)
    assert abs(score[3] - score[0]) < 0.2 * abs(score[0])  # resampled back to 64 px: nearly the same image


def test_batching_dtype_gradient_and_determinism(images):
    torch.manual_seed(0)
    small = LPIPSReward(random_init=True, batch_size=2)
    torch.manual_seed(0)
    big = LPIPSReward(random_init=True, batch_size=8)
    refs = images(8, seed=3)
    x = _noisy(refs, 0.1)
    meta = [{"reference": r} for r in refs]
    a, b = small(x, [""] * 8, meta).components["lpips"], big(x, [""] * 8, meta).components["lpips"]
    torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    assert torch.equal(a, small(x, [""] * 8, meta).components["lpips"])
    torch.manual_seed(0)
    bf16 = LPIPSReward(random_init=True, dtype="bf16")(x, [""] * 8, meta).components["lpips"]
    assert bf16.dtype == torch.float32
    torch.testing.assert_close(bf16, a, atol=0.05 * a.abs().max().item(), rtol=0)
    xg = x[:2].clone().requires_grad_(True)
    small(xg, ["", ""], meta[:2]).total.sum().backward()
    assert torch.isfinite(xg.grad).all() and xg.grad.abs().sum() > 0


def test_backbone_from_a_torchvision_checkpoint(tmp_path):
    """``backbone_path`` reads torchvision's ``features.{k}.*`` keys into lpips's sliced trunk."""
    torch.manual_seed(1)
    donor = LPIPSReward(random_init=True).model.net.state_dict()
    checkpoint = {re.sub(r"^slice\d+\.", "features.", k): v for k, v in donor.items()}
    checkpoint["classifier.1.weight"] = torch.zeros(2, 2)  # torchvision files hold the classifier too
    torch.save(checkpoint, tmp_path / "alexnet.pth")
    torch.manual_seed(2)
    loaded = LPIPSReward(backbone_path=str(tmp_path / "alexnet.pth"))
    for key, value in loaded.model.net.state_dict().items():
        assert torch.equal(value, donor[key]), key
    torch.save({"features.0.weight": torch.zeros(1)}, tmp_path / "wrong.pth")
    with pytest.raises(UserError, match="lacks"):
        LPIPSReward(backbone_path=str(tmp_path / "wrong.pth"))
    with pytest.raises(UserError, match="backbone_path='/no/alexnet.pth': no such file"):
        LPIPSReward(backbone_path="/no/alexnet.pth")


def test_missing_or_bad_reference_and_mask(reward, images):
    x = images(2, seed=4)
    with pytest.raises(UserError, match=r"metadata\[1\] has no 'reference'"):
        reward(x, ["", ""], [{"reference": x[0]}, {}])
    with pytest.raises(UserError, match=r"metadata\[0\] has no 'reference'"):
        reward(x, ["", ""], [])
    with pytest.raises(UserError, match=r'metadata\[0\]\["reference"\]=\'/no/ref.png\': no such file'):
        reward(x, ["", ""], [{"reference": "/no/ref.png"}] * 2)
    with pytest.raises(UserError, match=r'metadata\[0\]\["mask"\] selects no pixel'):
        reward(x, ["", ""], [{"reference": x[0], "mask": torch.zeros(64, 64)}] * 2)
    with pytest.raises(UserError, match="single-channel mask"):
        reward(x, ["", ""], [{"reference": x[0], "mask": torch.ones(3, 64, 64)}] * 2)
    with pytest.raises(UserError, match=r"must lie in \[0, 1\]"):
        reward(x, ["", ""], [{"reference": x[0] * 2 - 1}] * 2)
    with pytest.raises(UserError, match="net='resnet'"):
        LPIPSReward(net="resnet", random_init=True)
