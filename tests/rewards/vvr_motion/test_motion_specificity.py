"""Specificity: reversing time, swapping a direction or changing one object flips exactly the
constraints that change meaning, and no others."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from rewards.vvr_motion import MotionConstraint, MotionTask, generate_tasks, render, verify

_OPPOSITE = {"left": "right", "right": "left", "up": "down", "down": "up"}
_REVERSED_TYPE = {"toward": "away_from", "away_from": "toward", "grows": "shrinks", "shrinks": "grows"}
TASKS = generate_tasks(3, seed=33, level="easy") + generate_tasks(4, seed=33, level="medium") \
    + generate_tasks(12, seed=33, level="hard")


def _passed(task: MotionTask, clip: np.ndarray) -> list[bool]:
    v = verify(task, clip)
    assert v.valid, v.reason
    return [ok for _, ok in v.constraints]


def _reversed(task: MotionTask) -> MotionTask:
    """The task of the clip played backwards (no task type reverses ``appears``)."""
    cons = []
    for c in task.constraints:
        if c.type == "moves":
            cons.append(MotionConstraint("moves", {**c.args, "direction": _OPPOSITE[c.args["direction"]]}))
        else:
            cons.append(MotionConstraint(_REVERSED_TYPE.get(c.type, c.type), c.args))
    return replace(task, constraints=tuple(cons))


def _with_object(task: MotionTask, ref: dict, **changes) -> MotionTask:
    """``task`` with one object's motion fields (``end_x``, ``end_size``, ``appear``, ...) changed."""
    objs = tuple(replace(o, **changes) if o.ref == ref else o for o in task.objects)
    return replace(task, objects=objs)


def _names(c: MotionConstraint, ref: dict) -> bool:
    return ref in c.refs


def test_playing_backwards_flips_every_time_asymmetric_constraint_and_keeps_still():
    for t in TASKS:
        backwards = render(t)[::-1]
        assert _passed(t, backwards) == [c.type == "still" for c in t.constraints], t.prompt
        if not any(c.type == "appears" for c in t.constraints):
            assert all(_passed(_reversed(t), backwards)), t.prompt


def test_swapping_one_direction_flips_only_that_constraint():
    for t in [t for t in TASKS if any(c.type == "moves" for c in t.constraints)][:5]:
        clip = render(t)
        i = next(k for k, c in enumerate(t.constraints) if c.type == "moves")
        old = t.constraints[i].args["direction"]
        for new in (_OPPOSITE[old], "up" if old in ("left", "right") else "left"):  # reversed, perpendicular
            cons = list(t.constraints)
            cons[i] = MotionConstraint("moves", {**cons[i].args, "direction": new})
            expected = [k != i for k in range(len(cons))]
            assert _passed(replace(t, constraints=tuple(cons)), clip) == expected, (t.prompt, new)


def _first(kind: str) -> tuple[MotionTask, int]:
    for t in TASKS:
        for k, c in enumerate(t.constraints):
            if c.type == kind:
                return t, k
    raise AssertionError(f"no {kind} task")


def test_changing_one_object_flips_only_its_constraint():
    t, k = _first("still")
    ref = t.constraints[k].args["ref"]
    o = next(o for o in t.objects if o.ref == ref)
    # the still object drifts 0.15 of the frame toward the middle: its centres leave the 0.04 radius
    moved = _with_object(t, ref, end_x=o.start.x + (0.15 if o.start.x < 0.5 else -0.15))
    assert _passed(moved, render(moved)) == [j != k for j in range(len(t.constraints))], t.prompt

    for kind in ("grows", "shrinks"):
        t, k = _first(kind)
        ref = t.constraints[k].args["ref"]
        o = next(o for o in t.objects if o.ref == ref)
        fixed = _with_object(t, ref, end_size=o.start.size)
        assert _passed(fixed, render(fixed)) == [j != k for j in range(len(t.constraints))], t.prompt

    t, k = _first("appears")
    ref = t.constraints[k].args["ref"]
    always = _with_object(t, ref, appear=0.0)
    assert _passed(always, render(always)) == [j != k for j in range(len(t.constraints))], t.prompt

    t, k = _first("toward")
    ref = t.constraints[k].args["a"]
    o = next(o for o in t.objects if o.ref == ref)
    parked = _with_object(t, ref, end_x=o.start.x, end_y=o.start.y)
    assert _passed(parked, render(parked)) == [j != k for j in range(len(t.constraints))], t.prompt


def _without(task: MotionTask, ref: dict) -> MotionTask:
    return replace(task, objects=tuple(o for o in task.objects if o.ref != ref))


def test_flicker_and_identity_changes_fail_the_objects_constraints_only():
    t = next(t for t in TASKS if len(t.objects) == 3 and not any(c.type == "appears" for c in t.constraints))
    ref = t.objects[0].ref
    clip, gone = render(t), render(_without(t, ref))
    expected = [not _names(c, ref) for c in t.constraints]
    assert all(_passed(t, clip))

    flicker = clip.copy()
    flicker[3:5] = gone[3:5]  # gone for two frames in the middle: a disappearance
    assert _passed(t, flicker) == expected, t.prompt

    recoloured = replace(t, objects=tuple(
        replace(o, start=replace(o.start, colour="gray")) if o.ref == ref else o for o in t.objects))
    changed = clip.copy()
    changed[5:] = render(recoloured)[5:]  # turns grey for the last four frames: found in 5 of 9
    assert _passed(t, changed) == expected, t.prompt

    missed = clip.copy()
    missed[4] = gone[4]  # one missed frame is tolerated (a detection miss, not a disappearance)
    assert all(_passed(t, missed)), t.prompt
