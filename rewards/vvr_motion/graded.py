"""Graded credit for a failed motion constraint: how close the clip came, for RL shaping only.

[derived] Under the plain motion reward an easy task ("a red circle moving to the left") is one binary
constraint, so a clip that moves the right object most of the way scores the same 0 as a blank one, and
the policy gradient sees only the rare flips across the verifier's thresholds. This module reads the
verdict's tracks (``Track.summary``: found per frame, centres, areas) and scores a *failed* constraint in
[0, 1) as ``presence · progress`` with

* presence: the share of frames each referenced object is found with its colour and shape (product
  over the objects it names);
* progress: the mean of "how far" (displacement, area ratio or distance change as a share of the
  verifier's threshold, clipped to 1) and "how steadily" (the share of frame steps going the right
  way); for ``still``, the tolerance over the largest excursion; for ``appears``, absent at first and
  present at the end.

A passed constraint keeps credit 1. Benchmark accuracy and ``all_passed`` never use this.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from rewards.vvr_motion.tasks import MotionConstraint, ref_key
from rewards.vvr_motion.verify import AREA_RATIO, DIRECTION_AXIS, STILL_TOL, travel_threshold


def _track_arrays(summary: Mapping[str, Any]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(found ``(F,)`` bool, centres ``(K, 2)``, areas ``(K,)``) of the frames the object is found in."""
    found = np.array([ch == "1" for ch in summary["found"]])
    centres = np.array([c for c in summary["centre"] if c is not None], dtype=np.float64).reshape(-1, 2)
    areas = np.array([a for a in summary["area"] if a is not None], dtype=np.float64)
    return found, centres, areas


def _extent(areas: np.ndarray) -> float:
    # the summary keeps box areas, not sides: the side of a square of the median area stands in
    return float(np.sqrt(np.median(areas))) if len(areas) else 0.0


def _share_positive(steps: np.ndarray) -> float:
    return float(np.mean(steps > 0)) if len(steps) else 0.0


def _how_far(amount: float, threshold: float) -> float:
    return float(np.clip(amount / threshold, 0.0, 1.0)) if threshold > 0 else 0.0


def constraint_credit(c: MotionConstraint, tracks: Mapping[Any, Mapping[str, Any]]) -> float:
    """Credit in [0, 1] of constraint ``c`` that the verifier failed; ``tracks`` by descriptor key."""
    arrays = [_track_arrays(tracks[ref_key(r)]) for r in c.refs]
    presence = float(np.prod([found.mean() if len(found) else 0.0 for found, _, _ in arrays]))
    found, centres, areas = arrays[0]
    if c.type == "appears":
        return float(len(found) > 0 and not found[0] and found[-1])
    if c.type == "still":
        if not len(centres):
            return 0.0
        excursion = float(np.linalg.norm(centres - np.median(centres, 0), axis=1).max())
        return presence * min(1.0, STILL_TOL / max(excursion, 1e-9))
    if c.type == "moves":
        if len(centres) < 2:
            return 0.0
        axis, sign = DIRECTION_AXIS[c.args["direction"]]
        along = sign * (centres[-1, axis] - centres[0, axis])
        far = _how_far(along, travel_threshold(_extent(areas)))
        return presence * 0.5 * (far + _share_positive(sign * np.diff(centres[:, axis])))
    if c.type in ("grows", "shrinks"):
        if len(areas) < 2 or areas[0] <= 0 or areas[-1] <= 0:
            return 0.0
        sign = 1.0 if c.type == "grows" else -1.0
        far = _how_far(sign * np.log(areas[-1] / areas[0]), np.log(AREA_RATIO))
        return presence * 0.5 * (far + _share_positive(sign * np.diff(areas)))
    if c.type in ("toward", "away_from"):
        a, b = (tracks[ref_key(r)]["centre"] for r in c.refs[:2])
        pairs = [(pa, pb) for pa, pb in zip(a, b) if pa is not None and pb is not None]
        if len(pairs) < 2:
            return 0.0
        dist = np.array([np.hypot(pa[0] - pb[0], pa[1] - pb[1]) for pa, pb in pairs])
        sign = 1.0 if c.type == "toward" else -1.0
        far = _how_far(sign * (dist[0] - dist[-1]), travel_threshold(_extent(areas)))
        return presence * 0.5 * (far + _share_positive(-sign * np.diff(dist)))
    raise ValueError(f"unknown motion constraint type {c.type!r}")


def graded_credits(constraints: Sequence[MotionConstraint], passed: Sequence[bool],
                   detected: Sequence[Mapping[str, Any]]) -> list[float]:
    """Per constraint: 1 if the verifier passed it, else :func:`constraint_credit` from the verdict's
    ``detected`` track summaries."""
    tracks = {ref_key(s["ref"]): s for s in detected}
    return [1.0 if ok else constraint_credit(c, tracks) for c, ok in zip(constraints, passed)]
