"""Shared input checks of the image rewards (rewards/common.py)."""

from __future__ import annotations

import pytest
import torch

from flowalign.errors import UserError
from rewards.common import check_images, check_lengths, finite_mask, resolve_dtype


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


def test_lengths_and_dtypes():
    with pytest.raises(UserError, match="3 samples but 2 prompts"):
        check_lengths(3, ["a", "b"], [], "lpips")
    with pytest.raises(UserError, match="2 metadata"):
        check_lengths(3, ["a", "b", "c"], [{}, {}], "lpips")
    check_lengths(3, ["a", "b", "c"], [], "lpips")  # metadata may be omitted
    assert resolve_dtype("bf16", "x") is torch.bfloat16 and resolve_dtype(torch.float32, "x") is torch.float32
    with pytest.raises(UserError, match="dtype='int8'"):
        resolve_dtype("int8", "x")
