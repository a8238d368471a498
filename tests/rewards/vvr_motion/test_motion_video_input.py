"""Video input forms: arrays, tensors, PIL frames, files; bad input gives an invalid verdict, never raises."""

from __future__ import annotations

import imageio.v3 as iio
import numpy as np
import pytest
import torch
from PIL import Image

from rewards.vvr_motion import generate_tasks, render, verify

TASK = generate_tasks(1, seed=4, level="medium")[0]
CLIP = render(TASK)  # (9, 64, 64, 3) uint8


def _tensor(clip: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(clip).permute(0, 3, 1, 2).float() / 255  # (F, 3, H, W) in [0, 1]


@pytest.mark.parametrize("form", ["uint8", "float_tensor", "float_array_channels_first", "pil_list", "array_list"])
def test_accepted_forms_give_the_same_verdict(form):
    video = {
        "uint8": lambda: CLIP,
        "float_tensor": lambda: _tensor(CLIP),
        "float_array_channels_first": lambda: _tensor(CLIP).numpy(),
        "pil_list": lambda: [Image.fromarray(f) for f in CLIP],
        "array_list": lambda: list(CLIP),
    }[form]()
    v = verify(TASK, video)
    assert v.valid and v.all_passed and v.score == 1.0, (v.reason, v.constraints)


def test_video_file_path(tmp_path):
    path = tmp_path / "clip.mp4"
    iio.imwrite(path, CLIP, fps=8)
    v = verify(TASK, str(path))
    assert v.valid and len(v.detected) == 2, v.reason


def _invalid(video, needle: str) -> None:
    v = verify(TASK, video)
    assert not v.valid and v.score == 0.0 and not v.all_passed, v
    assert needle in v.reason, v.reason
    assert [k for k, _ in v.constraints] == [c.type for c in TASK.constraints]


def test_wrong_frame_count_says_expected_and_got():
    _invalid(render(TASK, num_frames=5), "expects 9 frames, got 5")
    _invalid(_tensor(render(TASK, num_frames=17)), "expects 9 frames, got 17")


def test_single_image_or_frame():
    for image in (CLIP[0], _tensor(CLIP)[0], Image.fromarray(CLIP[0]), CLIP[:1], _tensor(CLIP)[:1]):
        _invalid(image, "a video reward needs (F,3,H,W) clips; got a single image")


def test_unreadable_video_files(tmp_path):
    _invalid(str(tmp_path / "missing.mp4"), "cannot read video file")
    junk = tmp_path / "junk.mp4"
    junk.write_bytes(b"not a video")
    _invalid(junk, "cannot read video file")


def test_other_bad_input():
    nan = _tensor(CLIP)
    nan[2, 0, 5, 5] = float("nan")
    _invalid(nan, "NaN")
    _invalid(np.full_like(CLIP, 255), "blank video")
    _invalid(np.stack([CLIP, CLIP]), "a batch of clips")
    _invalid([Image.fromarray(CLIP[0]), Image.fromarray(CLIP[1]).resize((32, 32))], "frames differ in shape")
    _invalid([Image.fromarray(f).convert("L") for f in CLIP], "grayscale")
    _invalid(CLIP[..., 0], "grayscale clip")
    _invalid(CLIP[:, :8, :8], "too small")
    _invalid(None, "unreadable video of type NoneType")
    _invalid([], "empty list")
