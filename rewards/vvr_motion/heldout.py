"""The motion compositions held out of training: test prompts combine things no training prompt combines.

A motion task is *held out* when any of its clauses holds one of these compositions:

* a shape moving in a direction of ``HELDOUT_MOVES`` ("a red circle moving to the left"), whatever its
  colour. The pairs are the diagonal of the easy vocabulary: shape ``i`` of ``EASY_SHAPES`` with
  direction ``i`` of ``MOTION_DIRECTIONS``, so every shape and every direction still appears in
  training, only not together;
* a shape growing or shrinking as in ``HELDOUT_RESIZES`` ("a green hexagon ... growing");
* a mover of one shape going toward / away from a target of another as in ``HELDOUT_RELATIVE``.

The predicate reads only the constraints, so it is a function of the prompt.
``generate_tasks(..., exclude_heldout=True)`` (the default, used for training data) redraws every
held-out task; the test splits hold only held-out tasks.
"""

from __future__ import annotations

from typing import Iterable

from rewards.vvr.vocabulary import EASY_SHAPES
from rewards.vvr_motion.tasks import MOTION_DIRECTIONS, MotionConstraint

#: (shape, direction) of ``moves`` clauses no training prompt holds
HELDOUT_MOVES: frozenset[tuple[str, str]] = frozenset(zip(EASY_SHAPES, MOTION_DIRECTIONS))
#: (shape, "grows" | "shrinks") no training prompt holds
HELDOUT_RESIZES: frozenset[tuple[str, str]] = frozenset({
    ("circle", "shrinks"), ("square", "grows"), ("triangle", "shrinks"), ("star", "grows"),
    ("hexagon", "grows"), ("rectangle", "shrinks"),
})
#: ("toward" | "away_from", mover's shape, target's shape) no training prompt holds
HELDOUT_RELATIVE: frozenset[tuple[str, str, str]] = frozenset({
    ("toward", "circle", "square"), ("toward", "triangle", "star"), ("toward", "hexagon", "rectangle"),
    ("away_from", "square", "hexagon"), ("away_from", "star", "circle"), ("away_from", "rectangle", "triangle"),
})


def heldout_compositions(constraints: Iterable[MotionConstraint]) -> list[str]:
    """The held-out compositions the constraints hold, as readable strings (empty: a training prompt)."""
    found = []
    for c in constraints:
        shape = c.refs[0].get("shape")
        if c.type == "moves" and (shape, c.args["direction"]) in HELDOUT_MOVES:
            found.append(f"{shape} moving {c.args['direction']}")
        if c.type in ("grows", "shrinks") and (shape, c.type) in HELDOUT_RESIZES:
            found.append(f"{shape} {c.type}")
        if c.type in ("toward", "away_from") and (c.type, shape, c.args["b"].get("shape")) in HELDOUT_RELATIVE:
            found.append(f"{shape} {c.type} {c.args['b'].get('shape')}")
    return found


def is_heldout(constraints: Iterable[MotionConstraint]) -> bool:
    """Whether a motion task with these constraints belongs to the held-out (test) compositions."""
    return bool(heldout_compositions(constraints))
