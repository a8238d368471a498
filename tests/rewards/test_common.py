"""Shared input checks of the image rewards (rewards/common.py)."""

from __future__ import annotations

import pytest
import torch

from flowalign.errors import UserError
from rewards.common import check_images, check_lengths, constant, finite_mask, resolve_dtype
from tests.flowalign.fake_device import DEVICE, FakeDevice, OnDevice, host_waits


@pytest.mark.parametrize(
    "samples, match",
    [
        (torch.rand(2, 4, 3, 8, 8), "video batch.*'clip_score_video'"),
        (torch.rand(2, 1, 8, 8), r"\(B, 3, H, W\)"),
        (torch.rand(3, 8, 8), r"\(B, 3, H, W\)"),
        ((torch.rand(2, 3, 8, 8) * 255).to(torch.uint8), "float in \\[0, 1\\].*255"),
        (torch.rand(2, 3, 8, 8) * 2 - 1, "lie in \\[0, 1\\].*\\(x \\+ 1\\) / 2"),
        ([[0.5]], "torch.Tensor"),
    ],
)
def test_bad_samples_name_the_problem_and_fix(samples, match):
    with pytest.raises(UserError, match=match):
        check_images(samples, "clip_score")


def test_non_finite_values_are_not_a_range_error():
    x = torch.rand(2, 3, 8, 8)
    x[1, 0, 0, 0] = float("nan")
    x[1, 1, 0, 0] = float("inf")
    check_images(x, "clip_score")
    assert finite_mask(x).tolist() == [True, False]


def test_the_range_check_of_device_samples_waits_for_the_device_once():
    """A reward called inside an update (a reward gradient) checks its input: the extremes over the finite
    values are read back together, with no boolean index, and say the range (a value outside it raises)."""
    x = torch.rand(2, 3, 8, 8)
    x[0, 0, 0, 0] = float("nan")
    with FakeDevice():
        d = x.to(DEVICE)
        with host_waits() as found:
            check_images(d, "brightness")
        assert [kind for kind, _ in found] == ["read values"]
        with pytest.raises(UserError, match="got values in \\[-0.5, "):
            check_images(torch.cat([d, d[:1] * 0 - 0.5]), "brightness")
    check_images(torch.full((1, 3, 2, 2), float("nan")), "brightness")  # no finite value: nothing to check
    check_images(torch.empty(0, 3, 2, 2), "brightness")


def test_a_constant_is_copied_to_the_device_once_and_kept_per_dtype():
    with FakeDevice():
        d = torch.zeros(2, device=DEVICE)
        with host_waits() as found:
            first, again = constant((0.25, 0.5), d), constant([0.25, 0.5], d)
        assert isinstance(first, OnDevice) and again is first and first.tolist() == [0.25, 0.5]
        assert [kind for kind, _ in found] == ["blocking copy to the device"]
    assert constant((0.25, 0.5), d.double()).dtype == torch.float64 and constant((1, 2), torch.zeros(1)).device.type == "cpu"


def test_lengths_and_dtypes():
    with pytest.raises(UserError, match="3 samples but 2 prompts"):
        check_lengths(3, ["a", "b"], [], "lpips")
    with pytest.raises(UserError, match="2 metadata"):
        check_lengths(3, ["a", "b", "c"], [{}, {}], "lpips")
    check_lengths(3, ["a", "b", "c"], [], "lpips")  # metadata may be omitted
    assert resolve_dtype("bf16", "x") is torch.bfloat16 and resolve_dtype(torch.float32, "x") is torch.float32
    with pytest.raises(UserError, match="dtype='int8'"):
        resolve_dtype("int8", "x")
