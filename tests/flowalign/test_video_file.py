"""A reward entry's ``video_mp4_fps``: videos scored through the mp4 file DanceGRPO's and Pref-GRPO's scripts
write and read (``flowalign/video_file.py``)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import imageio_ffmpeg
import numpy as np
import pytest
import torch

from flowalign.config import RewardSpec, recorded_reward
from flowalign.errors import UserError
from flowalign.reward_set import load_rewards
from flowalign.video_file import Mp4RoundTrip, through_mp4

KNOWN = json.loads((Path(__file__).parent / "known_answers" / "mp4_round_trip.json").read_text())


def fixed_video() -> torch.Tensor:
    """``(9, 3, 48, 64)`` in [0, 1]: moving stripes and ramps with N(0, 0.05) noise (torch seed 0), clamped."""
    F, H, W = 9, 48, 64
    t = torch.arange(F, dtype=torch.float32)[:, None, None]
    y = torch.arange(H, dtype=torch.float32)[None, :, None]
    x = torch.arange(W, dtype=torch.float32)[None, None, :]
    base = torch.stack([(torch.sin(x / 7 + t) + 1) / 2 + 0 * y, (torch.cos(y / 5 - t) + 1) / 2 + 0 * x,
                        ((x + y + 3 * t) % 40) / 40], dim=1)
    noise = torch.randn(base.shape, generator=torch.Generator().manual_seed(0)) * 0.05
    return (base + noise).clamp(0, 1)


def as_8bit(frames: torch.Tensor) -> np.ndarray:
    """``(n, 3, H, W)`` in [0, 1] read from a file (multiples of 1/255) → ``(n, H, W, 3)`` uint8."""
    return (frames * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()


def test_the_fixed_video_is_the_one_the_known_answers_were_computed_on():
    assert hashlib.sha256(fixed_video().numpy().tobytes()).hexdigest() == KNOWN["input_sha256_float32"]


@pytest.mark.parametrize("case", KNOWN["cases"], ids=lambda c: f"fps{c['fps']}-frames{c['num_frames']}")
def test_the_frames_are_those_pref_grpos_reward_reads_from_its_file(case):
    """Their save_rollout_video (diffusers' export_to_video) then _extract_frames / the first-frame reader,
    run unchanged: the same pixels wherever the same ffmpeg encodes (byte for byte), else the same frames
    within the codec's rounding. The round trip itself moves pixels far (13.8 of 255 on this noisy video)."""
    video = fixed_video()
    read = through_mp4(video[None], case["fps"])[0]
    assert read.shape == video.shape
    picked = as_8bit(read[case["indices"]])
    assert list(picked.shape) == case["shape"]
    change = np.abs(picked.astype(int) - (video[case["indices"]] * 255).to(torch.uint8).permute(0, 2, 3, 1).numpy())
    assert change.mean() == pytest.approx(case["mean_abs_change_from_8bit_input"], rel=0.1)
    if imageio_ffmpeg.get_ffmpeg_version() == KNOWN["versions"]["ffmpeg"]:
        assert hashlib.sha256(picked.tobytes()).hexdigest() == case["frames_sha256"]
        assert hashlib.sha256(as_8bit(read[:1])[0].tobytes()).hexdigest() == case["first_frame_sha256"]
    else:  # another encoder build: its rounding, not another pipeline
        assert [float(f.mean()) for f in picked] == pytest.approx(case["frame_means"], abs=1.0)
    assert np.abs(picked[0, 0, :4].astype(int) - np.array(case["pixels_frame0_row0_first4"])).max() <= 3


def test_frames_off_the_macroblock_grid_are_scaled_up_as_imageio_writes_them():
    read = through_mp4(fixed_video()[None, :, :, :40, :40], 16)
    assert read.shape == (1, 9, 3, 48, 48)


def test_images_are_refused_naming_the_option():
    with pytest.raises(UserError, match="drop video_mp4_fps from an image reward's entry"):
        through_mp4(torch.rand(2, 3, 16, 16), 16)


def test_a_reward_entry_with_video_mp4_fps_scores_the_round_trip():
    video = fixed_video()[None].repeat(2, 1, 1, 1, 1)
    prompts, metadata = ["a", "b"], [{}, {}]
    through = load_rewards([RewardSpec(name="saturation_video", video_mp4_fps=16)])
    plain = load_rewards([RewardSpec(name="saturation_video")])
    reward = plain.entries[0][2]
    expected = reward(through_mp4(video, 16), prompts, metadata).components["saturation"]
    scored = through.score(video, prompts, metadata).values[:, 0]
    assert torch.allclose(scored, expected)
    assert not torch.allclose(scored, plain.score(video, prompts, metadata).values[:, 0], atol=1e-3)
    assert through.not_differentiable() == ["saturation_video"]


def test_the_round_trip_passes_the_rewards_attributes_and_is_recorded_only_when_set():
    class Judge:
        name, pairwise, differentiable = "judge", True, True

    wrapped = Mp4RoundTrip(Judge(), 16)
    assert (wrapped.name, wrapped.pairwise, wrapped.differentiable) == ("judge", True, False)
    assert "video_mp4_fps" not in recorded_reward(RewardSpec(name="brightness").model_dump())
    assert recorded_reward(RewardSpec(name="brightness", video_mp4_fps=24).model_dump())["video_mp4_fps"] == 24
