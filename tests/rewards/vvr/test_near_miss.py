"""Near-miss scenes and rendered preference pairs: exact labels from the verifier, deterministic."""

from __future__ import annotations

import random
from dataclasses import asdict

import numpy as np
import pytest

from rewards.vvr import generate_tasks, verify
from rewards.vvr.near_miss import mutate_object, mutate_scene, rendered_pairs

TASKS = generate_tasks(6, seed=4, level="easy") + generate_tasks(6, seed=4, level="medium") \
    + generate_tasks(4, seed=4, level="hard")


@pytest.mark.parametrize("kind", ["position", "colour", "size", "shape"])
def test_mutate_object_changes_exactly_that_field(kind):
    rng = random.Random(0)
    for task in TASKS:
        obj = task.objects[0]
        new = mutate_object(obj, kind, rng, task.background)
        changed = {k for k, v in asdict(obj).items() if asdict(new)[k] != v}
        if kind == "position":
            assert changed and changed <= {"x", "y"}
        else:
            assert changed == {kind}


def test_mutate_scene_keeps_objects_visible():
    """A new colour is never the background's and ``drop`` removes one object only when another remains;
    the constraints never change."""
    rng = random.Random(1)
    for task in TASKS * 20:
        new = mutate_scene(task, rng)
        assert new.constraints == task.constraints and new.background == task.background
        assert len(new.objects) in (len(task.objects), len(task.objects) - 1) and len(new.objects) >= 1
        assert all(o.colour != task.background for o in new.objects)
    one = next(t for t in TASKS if len(t.objects) == 1)
    assert all(len(mutate_scene(one, rng, kinds=("drop", "colour")).objects) == 1 for _ in range(20))


def test_rendered_pairs_are_verified_and_deterministic():
    pairs = list(rendered_pairs(TASKS, seed=3, size=64, per_task=2))
    assert len(pairs) >= len(TASKS)  # most tasks give both near misses
    for task, chosen, rejected, margin in pairs:
        good, bad = verify(task, chosen), verify(task, rejected)
        assert good.all_passed and not bad.all_passed and margin == pytest.approx(good.score - bad.score) and margin > 0
    again = list(rendered_pairs(TASKS, seed=3, size=64, per_task=2))
    assert [p[0].id for p in again] == [p[0].id for p in pairs]
    assert all(np.array_equal(np.asarray(a[2]), np.asarray(b[2])) for a, b in zip(pairs, again))
    other = list(rendered_pairs(TASKS, seed=4, size=64, per_task=2))
    assert any(not np.array_equal(np.asarray(a[2]), np.asarray(b[2])) for a, b in zip(pairs, other))


def test_unknown_mutation_is_named():
    with pytest.raises(ValueError, match="unknown mutation 'hue'"):
        mutate_object(TASKS[0].objects[0], "hue", random.Random(0))
