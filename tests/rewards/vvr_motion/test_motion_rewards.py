"""The registered ``vvr_motion`` and ``temporal_consistency`` rewards: protocol, shapes, valid masks, info."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import rewards
from flowalign.errors import UserError
from flowalign.protocols import Reward, RewardOutput
from rewards.vvr_motion import TemporalConsistencyReward, VVRMotionReward, generate_tasks, render


def _batch(tasks, size=64) -> torch.Tensor:
    """``(B, F, 3, H, W)`` float in [0, 1]."""
    return torch.stack([torch.from_numpy(render(t, size)).permute(0, 3, 1, 2).float() / 255 for t in tasks])


@pytest.mark.parametrize("name, cls", [("vvr_motion", VVRMotionReward), ("temporal_consistency", TemporalConsistencyReward)])
def test_registered_and_loadable(name, cls):
    assert name in rewards.available()
    reward = rewards.load(name)
    assert isinstance(reward, cls) and isinstance(reward, Reward)
    assert reward.name == name and reward.differentiable is False


def test_vvr_motion_scores_valid_mask_and_info():
    tasks = generate_tasks(3, seed=2, level="hard") + generate_tasks(1, seed=2, level="easy")
    x = _batch(tasks)
    x[1] = 1.0  # blank
    x[2] = x[2].flip(0)  # played backwards: its motion constraints fail
    x[0] = (x[0] * 1.02).clamp(max=1.04)  # a decoder's slight overshoot is clamped, not read as 0-255
    meta = [{"task": tasks[0]}, {"task": tasks[1].to_dict()}, {"task": tasks[2]}, {}]
    out = rewards.load("vvr_motion")(x, [t.prompt for t in tasks], meta)
    assert isinstance(out, RewardOutput) and set(out.components) == {"vvr_motion"}
    s = out.components["vvr_motion"]
    assert s.shape == (4,) and s.dtype == torch.float32
    assert out.valid.dtype == torch.bool and out.valid.tolist() == [True, False, True, False]
    assert s[0] == 1.0 and out.info[0]["all_passed"]
    assert [k for k, _ in out.info[0]["constraints"]] == [c.type for c in tasks[0].constraints]
    # per-clip tracks: one per object the constraints name, with a found flag per frame
    named = {tuple(sorted(r.items())) for c in tasks[0].constraints for r in c.refs}
    assert {tuple(sorted(t["ref"].items())) for t in out.info[0]["tracks"]} == named
    assert all(len(t["found"]) == 9 for t in out.info[0]["tracks"])
    assert "blank" in out.info[1]["reason"] and s[1] == 0.0
    assert 0.0 <= s[2] < 1.0 and not out.info[2]["all_passed"]
    assert "no 'task'" in out.info[3]["reason"] and len(out.info) == 4


def test_vvr_motion_gamma_nonfinite_and_frame_count():
    tasks = generate_tasks(2, seed=3, level="medium")
    x = _batch(tasks)
    x[1, 0, 0, 0, 0] = float("nan")
    out = VVRMotionReward(gamma=0.0)(x, ["", ""], [{"task": t} for t in tasks])
    assert out.valid.tolist() == [True, False] and "NaN" in out.info[1]["reason"]
    short = VVRMotionReward()(x[:, :5], ["", ""], [{"task": t} for t in tasks])
    assert not short.valid.any() and "expects 9 frames, got 5" in short.info[0]["reason"]
    with pytest.raises(UserError):
        VVRMotionReward(gamma=2.0)


@pytest.mark.parametrize("name", ["vvr_motion", "temporal_consistency"])
def test_images_are_refused(name):
    with pytest.raises(UserError, match=r"a video reward needs \(B,F,3,H,W\) clips; got a batch of images"):
        rewards.load(name)(torch.rand(2, 3, 64, 64), ["", ""], [{}, {}])


def test_temporal_consistency_reward():
    tasks = generate_tasks(3, seed=5, level="medium")
    x = _batch(tasks)
    x[1, 3:5] = 1.0  # every object gone for two frames
    x[2] = 0.5  # blank
    out = rewards.load("temporal_consistency")(x, [""] * 3, [{}] * 3)
    s = out.components["temporal_consistency"]
    assert set(out.components) == {"temporal_consistency"} and s.shape == (3,) and s.dtype == torch.float32
    assert out.valid.tolist() == [True, True, False] and "blank" in out.info[2]["reason"]
    assert s[0] == 1.0 and np.isclose(float(s[1]), 6 / 8) and len(out.info[0]["pairs"]) == 8
