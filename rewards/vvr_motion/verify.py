"""The deterministic motion verifier: clip + motion task → per-constraint pass/fail and the RL reward.

Each frame is segmented as in VVR and every referenced object is tracked by its descriptor
(``track``). A constraint holds only if each object it names is *steady* over the frames it should
be in (found with its colour + shape in ≥ 80 % of them, never missing 2 frames in a row: no
flicker); those frames are the whole clip, or from its first sighting on for an object the task
says ``appears``. Then, with positions and sizes in image fractions (so every threshold scales with the
frame size; "travel threshold" ``τ(e) = max(0.10, 0.5·e)`` for an object of median box extent ``e``:
6.4-11.5 px at 64 px, an object must move at least half its own size) [derived]:

* ``moves(ref, dir)``: net displacement first → last sighting along the axis ≥ τ, ≥ 2× the
  displacement across it, and ≥ 75 % of the frame-to-frame steps go that way (monotonic).
* ``still(ref)``: every sighted centre lies within 0.04 of the median centre (2.6 px at 64 px; a
  move of ≥ τ puts the ends ≥ 0.05 from any centre).
* ``appears(ref)``: absent from the first frame, present in the last, steady from its first sighting.
* ``grows(ref)`` / ``shrinks(ref)``: box area (w·h of the fitted shape, sub-pixel, steadier than a
  pixel count) last / first sighting ≥ 1.3 (≤ 1/1.3), and a trend: ≥ 75 % of all frame pairs
  (earlier, later) grow (shrink). Pairs, not steps: a one-class change grows the area by only ~8 % a
  step at 9 frames, within the ±10 % a JPEG'd 13 px triangle's fitted box wobbles, while a wobble
  reverses few of the 36 pairs.
* ``toward(a, b)`` / ``away_from(a, b)``: over frames holding both, the centre distance first → last
  falls (rises) by ≥ τ(A) and ≥ 75 % of steps fall (rise).

The verdict's ``detected`` lists each referenced object's track (``Track.summary``).
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from rewards.vvr.verify import Verdict, score
from rewards.vvr_motion.tasks import MotionConstraint, MotionTask, as_task, ref_key
from rewards.vvr_motion.track import Track, detect
from rewards.vvr_motion.video import BadVideo, as_clip

MIN_TRAVEL = 0.10  # τ's floor (image fractions)
TRAVEL_PER_EXTENT = 0.5  # τ's share of the object's extent
DOMINANCE = 2.0  # along-axis displacement over across-axis displacement, for moves
MONOTONE = 0.75  # share of steps (of frame pairs, for sizes) that must go the constrained way
STILL_TOL = 0.04  # largest distance of a still object's centre from its median centre
AREA_RATIO = 1.3  # area change of grows / shrinks
DIRECTION_AXIS = {"left": (0, -1.0), "right": (0, 1.0), "up": (1, -1.0), "down": (1, 1.0)}


def travel_threshold(extent: float) -> float:
    """τ(e): the displacement (image fractions) a move of an object of extent ``e`` must reach."""
    return max(MIN_TRAVEL, TRAVEL_PER_EXTENT * extent)


def _monotone(steps: np.ndarray) -> bool:
    """Most steps (``MONOTONE``) are positive; at least one step is needed."""
    return len(steps) > 0 and float(np.mean(steps > 0)) >= MONOTONE


def _trend(values: np.ndarray) -> bool:
    """Most (``MONOTONE``) pairs ``i < j`` of ``values`` increase: a rank trend robust to local noise."""
    i, j = np.triu_indices(len(values), 1)
    return len(i) > 0 and float(np.mean(values[j] > values[i])) >= MONOTONE


def _moves(tr: Track, direction: str) -> bool:
    _, centres, _ = tr.points()
    if len(centres) < 2:
        return False
    axis, sign = DIRECTION_AXIS[direction]
    net = centres[-1] - centres[0]
    along, across = sign * net[axis], abs(net[1 - axis])
    return (along >= travel_threshold(tr.extent()) and along >= DOMINANCE * across
            and _monotone(sign * np.diff(centres[:, axis])))


def _still(tr: Track) -> bool:
    _, centres, _ = tr.points()
    return len(centres) > 0 and float(np.linalg.norm(centres - np.median(centres, 0), axis=1).max()) <= STILL_TOL


def _resizes(tr: Track, sign: float) -> bool:
    _, _, areas = tr.points()
    if len(areas) < 2:
        return False
    ratio = areas[-1] / areas[0]
    return (ratio >= AREA_RATIO if sign > 0 else ratio <= 1 / AREA_RATIO) and _trend(sign * areas)


def _relative(a: Track, b: Track, sign: float) -> bool:
    """``sign`` +1: the distance A-B falls (toward); -1: it rises (away)."""
    both = a.found & b.found
    _, ca, _ = a.points(both)
    _, cb, _ = b.points(both)
    if len(ca) < 2:
        return False
    dist = np.linalg.norm(ca - cb, axis=1)
    return sign * (dist[0] - dist[-1]) >= travel_threshold(a.extent()) and _monotone(-sign * np.diff(dist))


def _appears(tr: Track) -> bool:
    first = tr.first()
    return first is not None and first > 0 and bool(tr.found[-1]) and tr.steady(first)


def check(c: MotionConstraint, tracks: dict[Any, Track], appearing: set[Any]) -> bool:
    """Whether constraint ``c`` holds on the ``tracks`` (by descriptor key); ``appearing``: keys of
    objects the task says appear (steady from their first sighting rather than from frame 0)."""
    objs = [tracks[ref_key(r)] for r in c.refs]
    if c.type == "appears":
        return _appears(objs[0])
    for r, tr in zip(c.refs, objs):
        start = (tr.first() or 0) if ref_key(r) in appearing else 0
        if not tr.steady(start):
            return False
    if c.type == "moves":
        return _moves(objs[0], c.args["direction"])
    if c.type == "still":
        return _still(objs[0])
    if c.type in ("grows", "shrinks"):
        return _resizes(objs[0], 1.0 if c.type == "grows" else -1.0)
    if c.type in ("toward", "away_from"):
        return objs[0] is not objs[1] and _relative(objs[0], objs[1], 1.0 if c.type == "toward" else -1.0)
    raise ValueError(f"unknown motion constraint type {c.type!r}")


def verify(task: MotionTask | Mapping[str, Any], video: Any) -> Verdict:
    """Check ``video`` against ``task`` (VVR's :class:`~rewards.vvr.verify.Verdict`).

    ``video``: ``(F, H, W, 3)`` uint8 numpy, ``(F, 3, H, W)`` float tensor in [0, 1], a list of PIL
    images or a video file path (``video.as_clip``); F must be the task's ``num_frames``. A malformed
    task raises ``ValueError``; an unusable video gives an invalid verdict (score 0, ``reason`` set).
    """
    task = as_task(task)

    def invalid(reason: str) -> Verdict:
        return Verdict([(c.type, False) for c in task.constraints], 0.0, False, valid=False, reason=reason)

    try:
        clip = as_clip(video)
    except BadVideo as e:
        return invalid(str(e))
    if len(clip) != task.num_frames:
        return invalid(f"wrong frame count: the task expects {task.num_frames} frames, got {len(clip)}: "
                       f"sample {task.num_frames}-frame clips (model.defaults.num_frames={task.num_frames})")
    scenes = detect(clip)
    tracks: dict[Any, Track] = {}
    for c in task.constraints:
        for r in c.refs:
            tracks.setdefault(ref_key(r), Track.follow(r, scenes))
    appearing = {ref_key(c.refs[0]) for c in task.constraints if c.type == "appears"}
    passed = [bool(check(c, tracks, appearing)) for c in task.constraints]
    return Verdict([(c.type, p) for c, p in zip(task.constraints, passed)], score(passed), all(passed),
                   detected=[t.summary() for t in tracks.values()])
