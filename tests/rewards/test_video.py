"""Video rewards: any image reward per frame, averaged, plus the temporal term."""

from __future__ import annotations

import pytest
import torch

import rewards
from flowalign.errors import UserError
from rewards.video import VideoReward, per_frame

PROMPTS = ["a red circle", "a blue square"]


def test_per_frame_average_equals_the_image_scores(tiny_clip_spec, images):
    video_reward = per_frame("clip_score", model=tiny_clip_spec)
    image_reward = video_reward.image_reward
    frames = images(6, seed=1).reshape(2, 3, 3, 64, 64)  # 2 videos x 3 frames
    out = video_reward(frames, PROMPTS, [{}, {}])
    assert video_reward.name == "clip_score_video" and video_reward.differentiable is True
    assert set(out.components) == {"clip_score"} and out.components["clip_score"].shape == (2,)
    per_image = image_reward(frames.flatten(0, 1), [p for p in PROMPTS for _ in range(3)], []).components["clip_score"]
    torch.testing.assert_close(out.components["clip_score"], per_image.reshape(2, 3).mean(1), atol=1e-6, rtol=0)
    assert out.valid.all() and len(out.info) == 0


def test_temporal_term_is_zero_for_a_still_video_and_negative_for_motion(images):
    still = images(1, seed=2).expand(4, -1, -1, -1)
    moving = images(4, seed=3)
    reward = rewards.load("brightness_video", temporal_weight=0.5)
    assert isinstance(reward, VideoReward) and reward.differentiable is True
    out = reward(torch.stack([still, moving]), ["", ""], [])
    temporal = out.components["temporal"]
    change = (moving[1:] - moving[:-1]).abs().mean()
    assert temporal[0] == 0 and torch.isclose(temporal[1], -0.5 * change)
    torch.testing.assert_close(out.total, out.components["brightness"] + temporal)
    x = torch.stack([still, moving]).requires_grad_(True)
    reward(x, ["", ""], []).total.sum().backward()
    assert torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0


def test_frames_get_their_videos_metadata_and_a_bad_frame_invalidates_its_video(images):
    torch.manual_seed(0)
    reward = rewards.load("lpips_video", random_init=True)
    ref = images(2, seed=4)
    videos = ref[:, None].repeat(1, 3, 1, 1, 1)
    videos[1, 2, 0, 0, 0] = float("nan")
    out = reward(videos, ["", ""], [{"reference": ref[0]}, {"reference": ref[1]}])
    assert out.valid.tolist() == [True, False]
    assert abs(out.components["lpips"][0]) < 1e-6  # every frame is its video's reference
    assert rewards.load("jpeg_compressibility_video").differentiable is False


def test_shapes_are_checked():
    with pytest.raises(UserError, match="scores videos"):
        per_frame("brightness")(torch.rand(2, 3, 8, 8), ["", ""], [])


def test_frames_first_scores_the_first_frame_alone(tiny_clip_spec, images):
    """Pref-GRPO's Wan scripts score CLIP on each video's first frame (``video_first_frame_to_pil``); a bad later
    frame still invalidates its video."""
    reward = rewards.load("clip_score_video", model=tiny_clip_spec, frames="first")
    frames = images(6, seed=5).reshape(2, 3, 3, 64, 64)
    frames[1, 2, 0, 0, 0] = float("nan")
    out = reward(frames, PROMPTS, [{}, {}])
    first = reward.image_reward(frames[:, 0], PROMPTS, []).components["clip_score"]
    torch.testing.assert_close(out.components["clip_score"], first, atol=0, rtol=0)
    assert out.valid.tolist() == [True, False]
    every = rewards.load("clip_score_video", model=tiny_clip_spec)(frames[:1], PROMPTS[:1], [{}])
    assert not torch.equal(every.components["clip_score"], first[:1])  # the other frames move the average
    with pytest.raises(UserError, match="frames='middle' is not known; use all"):
        rewards.load("brightness_video", frames="middle")
