"""Temporal consistency of object identity: stable clips score 1; flicker, identity changes and jumps cost."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from rewards.vvr_motion import generate_tasks, render, temporal_consistency

TASK = next(t for t in generate_tasks(20, seed=8, level="hard")
            if len(t.objects) == 3 and not any(c.type == "appears" for c in t.constraints))


def _variant(**changes) -> np.ndarray:
    """The clip with the first object's fields changed."""
    o = TASK.objects[0]
    return render(replace(TASK, objects=(replace(o, **changes),) + TASK.objects[1:]))


def test_rendered_motion_is_consistent():
    r = temporal_consistency(render(TASK))
    assert r.valid and r.score == 1.0 and r.pairs == [1.0] * 8


def test_an_appearing_object_costs_one_pair():
    r = temporal_consistency(_variant(appear=0.5))
    assert r.pairs == [1.0] * 3 + [2 / 3] + [1.0] * 4 and 0 <= r.score < 1


def test_flicker_colour_change_and_teleport_cost_the_pairs_they_touch():
    clip = render(TASK)
    gone = render(replace(TASK, objects=TASK.objects[1:]))
    flicker = clip.copy()
    flicker[4] = gone[4]
    assert temporal_consistency(flicker).pairs == [1.0] * 3 + [2 / 3] * 2 + [1.0] * 3

    o = TASK.objects[0]
    grey = _variant(start=replace(o.start, colour="gray"))
    changed = np.concatenate([clip[:5], grey[5:]])
    assert temporal_consistency(changed).pairs == [1.0] * 4 + [2 / 3] + [1.0] * 3

    jumped = _variant(start=replace(o.start, x=1 - o.start.x, y=1 - o.start.y), end_x=1 - o.end_x, end_y=1 - o.end_y)
    teleport = np.concatenate([clip[:5], jumped[5:]])
    r = temporal_consistency(teleport)
    assert r.pairs[4] < 1.0 and r.pairs[:4] == [1.0] * 4


def test_unreadable_clip_is_invalid():
    r = temporal_consistency(render(TASK)[0])
    assert not r.valid and r.score == 0.0 and "single image" in r.reason
