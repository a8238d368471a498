"""``vvr_motion`` with ``partial_credit``: failed constraints earn graded credit that orders clips by how
close they came, while passes, ``all_passed`` and the plain reward stay as they were."""

from __future__ import annotations

import pytest
import torch

from rewards.vvr_motion import VVRMotionReward, generate_tasks, render

TASKS = generate_tasks(4, seed=11, level="easy") + generate_tasks(4, seed=11, level="medium") \
    + generate_tasks(4, seed=11, level="hard")


def _batch(tasks, size=64) -> torch.Tensor:
    """``(B, F, 3, H, W)`` float in [0, 1]."""
    return torch.stack([torch.from_numpy(render(t, size)).permute(0, 3, 1, 2).float() / 255 for t in tasks])


def _scores(reward, x, tasks):
    out = reward(x, [t.prompt for t in tasks], [{"task": t} for t in tasks])
    return out.components["vvr_motion"], out


def test_passing_clips_and_verdicts_are_unchanged():
    x = _batch(TASKS)
    graded, out_g = _scores(VVRMotionReward(partial_credit=True), x, TASKS)
    plain, out_p = _scores(VVRMotionReward(), x, TASKS)
    assert torch.equal(graded, plain) and bool((plain == 1.0).all())
    assert [i["all_passed"] for i in out_g.info] == [i["all_passed"] for i in out_p.info]


def test_graded_credit_orders_failed_easy_clips():
    """Easy tasks are one binary ``moves``: the plain reward scores half the motion, no motion and
    reversed motion alike (0); graded credit puts half the motion above no motion, and no motion and
    reversed motion at 0, all below a pass."""
    easy = TASKS[:4]
    x = _batch(easy)
    half = x[:, torch.tensor([0, 0, 1, 1, 2, 2, 3, 3, 4])]  # the first half of the move, slowed down
    frozen = x[:, :1].expand_as(x).contiguous()
    backwards = x.flip(1)
    reward, plain = VVRMotionReward(partial_credit=True), VVRMotionReward()
    for clip in (half, frozen, backwards):
        assert bool((_scores(plain, clip, easy)[0] == 0).all())
    s_half, s_frozen, s_back = (_scores(reward, c, easy)[0] for c in (half, frozen, backwards))
    assert bool((s_half > s_frozen).all()) and bool((s_half < 0.5).all())  # a pass scores 1, a fail at most 1 - γ
    assert bool((s_frozen == 0).all()) and bool((s_back == 0).all())


def test_graded_credit_scales_with_presence():
    """A full move whose object vanishes in 4 of 9 frames fails (flicker) and earns its progress (1)
    times the share of frames the object is found in (5/9); a recoloured clip earns nothing."""
    easy = TASKS[:4]
    x = _batch(easy)
    x[:, 1::2] = 1.0  # white frames 1, 3, 5, 7
    graded, out = _scores(VVRMotionReward(partial_credit=True), x, easy)
    assert not any(i["all_passed"] for i in out.info)
    assert torch.allclose(graded, torch.full((4,), 0.5 * 5 / 9)), [i["tracks"] for i in out.info]
    recoloured = _batch(easy)[:, :, torch.tensor([2, 0, 1])]  # RGB rotated: no object has its colour
    assert bool((_scores(VVRMotionReward(partial_credit=True), recoloured, easy)[0] == 0).all())


@pytest.mark.parametrize("level", ["medium", "hard"])
def test_graded_scores_stay_in_range(level):
    tasks = generate_tasks(6, seed=5, level=level)
    x = _batch(tasks).flip(1)
    graded, out = _scores(VVRMotionReward(partial_credit=True), x, tasks)
    plain, _ = _scores(VVRMotionReward(), x, tasks)
    assert bool((graded >= plain).all()) and bool((graded <= 1).all())
    assert bool((graded[~torch.tensor([i["all_passed"] for i in out.info])] < 1).all())
