"""Seeded generation of motion tasks: plan each object's role, lay out paths that never meet, name them.

Task ``i`` of ``generate_tasks(n, seed=s, level=l)`` draws its *plan* (object count, roles, colours,
shapes, sizes, directions, distances, appearance times) from ``random.Random("vvr_motion:l:s:i")`` and
its *layout* (start positions) from ``random.Random("vvr_motion:l:s:i:layout")`` (string seeds hash
with SHA-512, not ``hash()``), so tasks are identical across runs and processes and a longer list starts
with the shorter one. A plan that holds a held-out composition (``rewards.vvr_motion.heldout``) is
drawn again for training; :func:`generate_heldout_tasks` keeps only those (the test splits). A plan
whose paths do not fit is laid out again (up to ``LAYOUTS_PER_PLAN`` times) before a new plan is drawn,
so crowded plans (three objects, long moves) are not under-represented.

Levels [derived]:

* easy: one filled medium object of VVR's easy vocabulary moving left/right/up/down:
  "a red circle moving to the right".
* medium: VVR's medium vocabulary; two objects, one moving and one still ("a red circle moving up while a
  blue square stays still"), or one object moving while it grows or shrinks.
* hard: 2-3 objects, ≥ 2 constraints, always a relative one (``toward`` / ``away_from`` a target that
  stays in place); the target may also be still/grow/shrink (or go unmentioned beyond being the target
  when there is a third object); a third object moves, stays still, appears, grows, shrinks, or moves
  while changing size. Constraint groups are shuffled, so the relative clause need not lead.

Every object is filled, on white, and its colour differs from every other object's (so every
descriptor is unique). Margins over the verifier's thresholds (``rewards.vvr_motion.verify``) so that a
rendered clip passes after JPEG and blur [derived]: axis moves travel 0.25-0.45 of the frame (the
verifier needs 0.10-0.18), relative moves 0.22-0.35 (less where the pair's sizes leave no room; the
mover is small or medium) straight at/away from the target's centre; sizes
change by at least one size class (area × ≥ 1.78; the verifier needs × 1.3); objects appear at
t ∈ [0.25, 0.6] (never in the first frame, visible in the last ≥ 40 % of the clip); at every time
all visible boxes keep VVR's gap (0.07) and stay 0.03 inside the border, so no object ever hides,
touches or leaves the frame.
"""

from __future__ import annotations

import functools
import math
import random
from dataclasses import replace
from typing import Callable

import numpy as np

from rewards.vvr.geometry import NOT_SMALL, SIZE_EXTENT
from rewards.vvr.predicates import Box
from rewards.vvr.scene import EDGE, GAP, Retry, box_gap
from rewards.vvr.tasks import LEVELS, Obj
from rewards.vvr.vocabulary import VOCABULARIES, Vocabulary
from rewards.vvr_motion.heldout import is_heldout
from rewards.vvr_motion.tasks import (
    MOTION_DIRECTIONS,
    NUM_FRAMES,
    MotionConstraint,
    MotionObj,
    MotionTask,
    checked_frames,
)

MOVE_TRAVEL = (0.25, 0.45)  # axis moves: distance travelled (image fractions)
RELATIVE_TRAVEL = (0.22, 0.35)  # toward / away: distance travelled along the line to the target
RELATIVE_SIZES = ("small", "medium")  # a large mover and a large target leave no room for a long path
APPEAR = (0.25, 0.6)  # appearing objects show up at this time
#: (start, end) size classes of a growing object; shrinking ones run them backwards
GROWTHS: tuple[tuple[str, str], ...] = (("small", "medium"), ("medium", "large"), ("small", "large"))
_STEP = {"left": (-1.0, 0.0), "right": (1.0, 0.0), "up": (0.0, -1.0), "down": (0.0, 1.0)}
_CHECK_TIMES = np.linspace(0.0, 1.0, 33)  # paths are checked here: every frame of 5, 9, 17, 33-frame clips
#: a hard task's third object: its role
THIRD_ROLES = ("moves", "still", "appears", "grows", "shrinks", "moves_resize")
LAYOUTS_PER_PLAN = 50


def _inside(b: Box) -> bool:
    """The box keeps ``EDGE`` from every border."""
    return (EDGE - 1e-9 <= b.cx - b.w / 2 and b.cx + b.w / 2 <= 1 - EDGE + 1e-9
            and EDGE - 1e-9 <= b.cy - b.h / 2 and b.cy + b.h / 2 <= 1 - EDGE + 1e-9)


@functools.lru_cache(maxsize=4096)
def _path(o: MotionObj) -> tuple[Box | None, ...]:
    """A placed object's box at each of ``_CHECK_TIMES`` (None before it appears), computed once: every
    candidate drawn after it is checked against it."""
    return tuple(o.box(t) if o.visible(t) else None for t in _CHECK_TIMES)


class _Clip:
    """A moving scene under construction: objects whose paths fit the frame and keep apart.

    Plan draws (descriptors, roles, motions) come from ``rng``; positions from ``layout``, so a
    failed layout is redrawn without changing the plan.
    """

    def __init__(self, rng: random.Random, layout: random.Random, vocab: Vocabulary, n: int):
        self.rng, self.layout, self.vocab = rng, layout, vocab
        self.colours = rng.sample(vocab.colours, n)  # one colour per object: unique descriptors
        self.described = 0
        self.objs: list[MotionObj] = []

    def describe(self, sizes: tuple[str, str] | None = None) -> tuple[str, str, tuple[str, str]]:
        """The next object's (colour, shape, (start, end) size classes); default sizes: one random class."""
        colour = self.colours[self.described]
        self.described += 1
        if sizes is None:
            sizes = (self.rng.choice(self.vocab.sizes),) * 2
        # hexagons and pentagons are never small in VVR (they read as circles at 13 px)
        shape = self.rng.choice([s for s in self.vocab.shapes if "small" not in sizes or s not in NOT_SMALL])
        return colour, shape, sizes

    @staticmethod
    def make(desc: tuple[str, str, tuple[str, str]], start: tuple[float, float], end: tuple[float, float],
             appear: float = 0.0) -> MotionObj:
        colour, shape, (s0, s1) = desc
        return MotionObj(Obj(0, shape, colour, s0, True, round(start[0], 4), round(start[1], 4)),
                         round(end[0], 4), round(end[1], 4), s1, round(appear, 4))

    def _fits(self, cand: MotionObj, others: list[MotionObj]) -> bool:
        # box edges move linearly in t: inside at both ends is inside throughout
        if not (_inside(cand.box(0.0)) and _inside(cand.box(1.0))):
            return False
        paths = [_path(o) for o in others]
        for k, t in enumerate(_CHECK_TIMES):
            if not cand.visible(t):
                continue
            box = None
            for path in paths:
                if path[k] is not None:
                    box = box or cand.box(t)
                    if box_gap(box, path[k]) < GAP:
                        return False
        return True

    def place(self, draw: Callable[[], list[MotionObj]]) -> list[MotionObj]:
        """Add the objects ``draw()`` lays out (a single object or a pair), redrawn until they all fit."""
        for _ in range(200):
            group = draw()
            placed: list[MotionObj] = []
            for cand in group:
                if not self._fits(cand, self.objs + placed):
                    break
                placed.append(cand)
            else:
                self.objs.extend(placed)
                return placed
        raise Retry

    def anywhere(self) -> tuple[float, float]:
        return self.layout.uniform(0.1, 0.9), self.layout.uniform(0.1, 0.9)

    # --- roles: each places its object(s) and returns the constraints they hold --------------------
    def moves(self, sizes: tuple[str, str] | None = None) -> tuple[MotionObj, list[MotionConstraint]]:
        """An object travelling left / right / up / down (changing size when ``sizes`` differ)."""
        desc = self.describe(sizes)
        direction = self.rng.choice(MOTION_DIRECTIONS)
        travel = self.rng.uniform(*MOVE_TRAVEL)
        dx, dy = _STEP[direction]

        def draw() -> list[MotionObj]:
            x, y = self.anywhere()
            return [self.make(desc, (x, y), (x + travel * dx, y + travel * dy))]

        (o,) = self.place(draw)
        return o, [MotionConstraint("moves", {"ref": o.ref, "direction": direction})]

    def resized(self, kind: str) -> tuple[str, str]:
        """(start, end) size classes of a growing or shrinking object."""
        pair = self.rng.choice(GROWTHS)
        return pair if kind == "grows" else (pair[1], pair[0])

    def static(self, role: str) -> tuple[MotionObj, list[MotionConstraint]]:
        """An object that stays in place and is ``still`` / ``appears`` / ``grows`` / ``shrinks``."""
        desc = self.describe(self.resized(role) if role in ("grows", "shrinks") else None)
        appear = self.rng.uniform(*APPEAR) if role == "appears" else 0.0

        def draw() -> list[MotionObj]:
            at = self.anywhere()
            return [self.make(desc, at, at, appear)]

        (o,) = self.place(draw)
        return o, [MotionConstraint(role, {"ref": o.ref})]

    def relative(self, target_role: str, kind: str) -> list[list[MotionConstraint]]:
        """A target staying in place (``target_role`` still / grows / shrinks, or "unnamed": still and
        said nothing of) and an object moving straight toward / away from its centre, laid out
        together: the mover's near end lies just beyond VVR's gap from the target."""
        target = self.describe(self.resized(target_role) if target_role in ("grows", "shrinks") else None)
        mover = self.describe((self.rng.choice(RELATIVE_SIZES),) * 2)
        # the boxes' half-sums, bounded by extents (a box is at most extent × extent)
        reach = (SIZE_EXTENT[mover[2][0]] + max(SIZE_EXTENT[s] for s in target[2])) / 2
        # on a diagonal, the path and the gap need (GAP + reach + travel/√2) per axis of the 0.94 - reach
        # the frame leaves; 80 % of the longest such travel leaves room for the layout
        longest = math.sqrt(2) * (1 - 2 * EDGE - GAP - 2 * reach)
        travel = self.rng.uniform(RELATIVE_TRAVEL[0], min(RELATIVE_TRAVEL[1], 0.8 * longest))

        def draw() -> list[MotionObj]:
            tx, ty = self.anywhere()
            # the path lies on the side of the target facing the middle of the frame, where there is room
            angle = math.atan2(0.5 - ty, 0.5 - tx) + self.layout.uniform(-0.5 * math.pi, 0.5 * math.pi)
            ux, uy = math.cos(angle), math.sin(angle)
            near = min((GAP + reach) / abs(u) if abs(u) > 1e-6 else math.inf for u in (ux, uy))
            near += self.layout.uniform(0.0, 0.05)
            far = near + travel
            d0, d1 = (far, near) if kind == "toward" else (near, far)
            return [self.make(target, (tx, ty), (tx, ty)),
                    self.make(mover, (tx + d0 * ux, ty + d0 * uy), (tx + d1 * ux, ty + d1 * uy))]

        t, m = self.place(draw)
        groups = [[MotionConstraint(kind, {"a": m.ref, "b": t.ref})]]
        if target_role != "unnamed":
            groups.append([MotionConstraint(target_role, {"ref": t.ref})])
        return groups


def _easy(rng: random.Random, layout: random.Random) -> tuple[list[MotionObj], list[MotionConstraint]]:
    clip = _Clip(rng, layout, VOCABULARIES["easy"], 1)
    _, cons = clip.moves()
    return clip.objs, cons


def _medium(rng: random.Random, layout: random.Random) -> tuple[list[MotionObj], list[MotionConstraint]]:
    if rng.random() < 0.5:
        clip = _Clip(rng, layout, VOCABULARIES["medium"], 2)
        _, moving = clip.moves()
        _, still = clip.static("still")
        return clip.objs, moving + still
    clip = _Clip(rng, layout, VOCABULARIES["medium"], 1)
    kind = rng.choice(["grows", "shrinks"])
    o, cons = clip.moves(clip.resized(kind))
    return clip.objs, cons + [MotionConstraint(kind, {"ref": o.ref})]


def _hard(rng: random.Random, layout: random.Random) -> tuple[list[MotionObj], list[MotionConstraint]]:
    n = rng.choice([2, 3, 3])
    clip = _Clip(rng, layout, VOCABULARIES["medium"], n)
    # with two objects the target must say something too: hard tasks hold ≥ 2 constraints
    target_role = rng.choice(["still", "grows", "shrinks"] + (["unnamed"] if n == 3 else []))
    groups = clip.relative(target_role, rng.choice(["toward", "away_from"]))
    if n == 3:
        role = rng.choice(THIRD_ROLES)
        if role == "moves":
            groups.append(clip.moves()[1])
        elif role == "moves_resize":
            kind = rng.choice(["grows", "shrinks"])
            o, cons = clip.moves(clip.resized(kind))
            groups.append(cons + [MotionConstraint(kind, {"ref": o.ref})])
        else:
            groups.append(clip.static(role)[1])
    rng.shuffle(groups)
    return clip.objs, [c for g in groups for c in g]


_BUILDERS = {"easy": _easy, "medium": _medium, "hard": _hard}


def _draw(level: str, seed: int, i: int, frames: int, exclude_heldout: bool) -> MotionTask:
    """Task ``i`` of ``level`` for ``seed``; with ``exclude_heldout`` a held-out plan is drawn again."""
    rng = random.Random(f"vvr_motion:{level}:{seed}:{i}")
    layout = random.Random(f"vvr_motion:{level}:{seed}:{i}:layout")
    plan, failed = rng.getstate(), 0
    for _ in range(1000):
        rng.setstate(plan)
        try:
            objs, constraints = _BUILDERS[level](rng, layout)
        except Retry:
            failed += 1
            if failed % LAYOUTS_PER_PLAN == 0:
                plan = rng.getstate()  # a new plan after LAYOUTS_PER_PLAN failed layouts
            continue
        if exclude_heldout and is_heldout(constraints):
            plan, failed = rng.getstate(), 0
            continue
        objs = [replace(o, start=replace(o.start, id=k)) for k, o in enumerate(objs)]  # ids in paint order
        return MotionTask(f"motion-{level}-{seed}-{i}", level, frames, "white", tuple(objs), tuple(constraints))
    raise RuntimeError(f"could not generate motion task {level}-{seed}-{i}")  # pragma: no cover


def _check_level(level: str) -> None:
    if level not in LEVELS:
        raise ValueError(f"level: {level!r} is not allowed; allowed values: {', '.join(LEVELS)}")


def generate_tasks(n: int, *, seed: int, level: str, num_frames: int = NUM_FRAMES,
                   exclude_heldout: bool = True) -> list[MotionTask]:
    """``n`` motion tasks of ``level`` ("easy" | "medium" | "hard"), deterministic for ``seed``.

    ``num_frames`` is the clip length the tasks are checked at (the motion itself is in normalised
    time). ``exclude_heldout`` (the default, for training data) redraws every task that holds a held-out
    composition (``rewards.vvr_motion.heldout``). Seeds < 1000 are for training; the shipped splits use
    2001-2003 (test) and 2101-2103 (validation).
    """
    _check_level(level)
    frames = checked_frames(num_frames, "num_frames")
    return [_draw(level, seed, i, frames, exclude_heldout) for i in range(n)]


def generate_heldout_tasks(n: int, *, seed: int, level: str, num_frames: int = NUM_FRAMES) -> list[MotionTask]:
    """``n`` motion tasks of ``level`` that hold a held-out composition: the draws ``generate_tasks``
    excludes (task ids keep the draw's index)."""
    _check_level(level)
    frames = checked_frames(num_frames, "num_frames")
    tasks: list[MotionTask] = []
    i = 0
    while len(tasks) < n:
        task = _draw(level, seed, i, frames, exclude_heldout=False)
        if is_heldout(task.constraints):
            tasks.append(task)
        i += 1
    return tasks
