"""The three dimensions of motion fidelity, each a score in [0, 1] and a failure cause, read in motion space.

Every dimension sums the penalties of the findings it finds and scores ``exp(−Σ penalty)`` (1: no finding);
its cause names the costliest findings (up to ``MAX_CAUSES``), frames numbered from 0. Positions and sizes
are image fractions, so the thresholds hold at any frame size [derived: set on rendered VVR motion
clips, where a clean clip has no finding and each injected defect of ``defects.py`` one; see
``scripts/motion_insight_diagnostics.py``]:

* **consistency**: each object is there, one piece, looking the same, and keeps its identity (a clip
  with no object at all scores as one never-seen object).
  Missing frames (from the frame it should be seen in) cost ``MISSING_WEIGHT`` × their share ("object 2
  (blue square) disappears at frame 5"); a frame in two pieces ``SPLIT_WEIGHT``; fill or aspect off the
  object's median by more than ``FILL_TOL`` / ``ASPECT_TOL`` costs ``SHAPE_WEIGHT`` per tolerance of
  excess ("changes shape"); two objects that jump at the same step, each onto the other's path, have
  swapped identity: ``SWAP_WEIGHT`` ("objects 1 and 2 swap identity at frame 4").
* **continuity**: velocities and sizes change smoothly. An acceleration ``|v_{t+1} − v_t|`` beyond
  ``ACC_TOL + ACC_REL · median speed`` costs its excess over ``ACC_SCALE`` ("speed jumps 4.0x between
  frames 3 and 4", "freezes from frame 3 to frame 5"); a change of the per-frame log-area step beyond
  ``SIZE_TOL`` its excess over ``SIZE_SCALE`` ("size jumps 2.1x"). Size, shape and position tolerances
  also allow for pixel quantisation (``PIXEL_NOISE``), which matters at 32 px.
* **plausibility**: solid objects do not pass through each other. In a frame where two objects may
  overlap (their boxes intersect or their masks come within 2 px), the overlap is the larger of their
  boxes' intersection over the smaller box and the share of either's expected area (interpolated over
  the frames where it is clear of others) that is hidden beyond pixel noise; an object missing where its
  path runs inside another's box is wholly hidden (1). Each frame's largest overlap costs ``1 / OVERLAP_SCALE``
  per unit ("object 2 passes through object 1 in frames 3-5").
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
from scipy import ndimage

from rewards.motion_insight.space import MotionSpace, ObjectTrack

DIMENSIONS: tuple[str, ...] = ("consistency", "continuity", "plausibility")
MAX_CAUSES = 2

MISSING_WEIGHT = 3.0
SPLIT_WEIGHT = 0.3
SHAPE_WEIGHT = 0.5
FILL_TOL = 0.15
ASPECT_TOL = math.log(1.35)
SWAP_WEIGHT = 1.5
#: pixel quantisation: an edge half a pixel off changes an object of ``a`` px by about ``2/√a`` of its
#: area, fill and aspect; tolerances on sizes and shapes grow by ``PIXEL_NOISE × 2/√a`` (0.16 for a 10×10
#: px object), on positions by ``PIXEL_NOISE`` px
PIXEL_NOISE = 0.8

ACC_TOL = 0.02
ACC_REL = 0.25
ACC_SCALE = 0.1
SIZE_TOL = 0.3
SIZE_SCALE = 1.0
MOVING = 0.015  # median speed (image fractions a frame) above which an object counts as moving
FREEZE_SHARE = 0.25  # a step this much slower than the median step of a moving object is a freeze
JUMP = 0.06  # a step at least this long and ACC_TOL beyond its neighbours is a jump (swap candidates)

OVERLAP_SCALE = 0.5


@dataclass
class Finding:
    """One problem found: its penalty, the frame it starts at, and the sentence that names it."""

    penalty: float
    frame: int
    text: str
    #: findings with one key are one event (a jump's two accelerations, on and off): merged, costing both
    key: str = ""


@dataclass
class Dimension:
    """A dimension's ``score`` in [0, 1], its ``findings`` and ``cause`` (the costliest findings' text, "" when none)."""

    score: float
    findings: list[Finding] = field(default_factory=list)

    @property
    def cause(self) -> str:
        worst = sorted(self.findings, key=lambda i: -i.penalty)[:MAX_CAUSES]
        return "; ".join(i.text for i in sorted(worst, key=lambda i: i.frame))

    @staticmethod
    def of(findings: list[Finding]) -> Dimension:
        return Dimension(float(math.exp(-sum(i.penalty for i in findings))), findings)


def _runs(frames: list[int]) -> list[tuple[int, int]]:
    """Sorted frame indices → inclusive (first, last) runs of consecutive frames."""
    runs: list[tuple[int, int]] = []
    for f in frames:
        if runs and f == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], f)
        else:
            runs.append((f, f))
    return runs


def _inside(point: tuple[float, float], box: tuple[float, float, float, float]) -> bool:
    return box[0] <= point[0] <= box[2] and box[1] <= point[1] <= box[3]


def _hider(space: MotionSpace, track: ObjectTrack, f: int) -> ObjectTrack | None:
    """The object whose box holds where ``track`` would be at frame ``f`` (it is hidden there), if any."""
    at = track.interpolated_centre(f)
    if at is None:
        return None
    return next((o for o in space.tracks if o is not track and (box := o.box_at(f)) is not None
                 and _inside(at, box)), None)


# --------------------------------------------------------------------------------------------- consistency


def _jumps(track: ObjectTrack) -> list[tuple[int, np.ndarray, np.ndarray]]:
    """(frame it lands on, centre before, centre after) of each step of ``track`` between consecutive
    frames that is ≥ ``JUMP`` and ``ACC_TOL`` longer than the median step."""
    found = track.found
    c = track.centres
    steps = [np.linalg.norm(c[f + 1] - c[f]) for f in range(len(found) - 1) if found[f] and found[f + 1]]
    med = float(np.median(steps)) if steps else 0.0
    out = []
    for f in range(len(found) - 1):
        if found[f] and found[f + 1]:
            d = float(np.linalg.norm(c[f + 1] - c[f]))
            if d >= JUMP and d >= med + ACC_TOL + ACC_REL * med:
                out.append((f + 1, c[f], c[f + 1]))
    return out


def swaps(space: MotionSpace) -> list[tuple[ObjectTrack, ObjectTrack, int]]:
    """Pairs of objects that jump onto each other's place at the same frame: (a, b, frame)."""
    jumps = {t.index: _jumps(t) for t in space.tracks}
    out = []
    for i, a in enumerate(space.tracks):
        for b in space.tracks[i + 1 :]:
            for fa, a0, a1 in jumps[a.index]:
                for fb, b0, b1 in jumps[b.index]:
                    if fa != fb:
                        continue
                    reach = 0.5 * min(np.linalg.norm(a1 - a0), np.linalg.norm(b1 - b0))
                    if np.linalg.norm(a1 - b0) <= reach and np.linalg.norm(b1 - a0) <= reach:
                        out.append((a, b, fa))
    return out


def consistency(space: MotionSpace, swapped: list[tuple[ObjectTrack, ObjectTrack, int]]) -> Dimension:
    findings: list[Finding] = []
    n = space.num_frames
    if not space.tracks:  # a blank clip is no consistent scene: it would otherwise score 1 everywhere
        return Dimension.of([Finding(MISSING_WEIGHT, 0, "no objects found")])
    for t in space.tracks:
        expected = list(range(min(t.expected_from, n - 1), n))
        found = t.found
        missing = [f for f in expected if not found[f]]
        if not found.any():
            findings.append(Finding(MISSING_WEIGHT, expected[0], f"{t.label} never appears"))
            continue
        for first, last in _runs(missing):
            share = (last - first + 1) / len(expected)
            if first == expected[0] and t.expected_from > 0 and last < n - 1:
                text = f"{t.label} appears late, at frame {last + 1}"
            elif first == expected[0] and last < n - 1:
                text = f"{t.label} is missing until frame {last + 1}"
            else:
                hider = _hider(space, t, first)
                text = (f"{t.label} disappears at frame {first}"
                        + (" and does not return" if last == n - 1 else
                           f" for {last - first + 1} frame{'s' if last > first else ''}")
                        + (f" (hidden by {hider.label})" if hider is not None else ""))
            findings.append(Finding(MISSING_WEIGHT * share, first, text))
        for first, last in _runs(t.splits):
            findings.append(Finding(SPLIT_WEIGHT * (last - first + 1), first,
                                f"{t.label} splits into pieces at frame {first}"))
        seen = [b for b in t.blobs if b is not None]
        if len(seen) >= 3:
            fill = np.array([b.fill for b in seen])
            aspect = np.log(np.array([b.aspect for b in seen]))
            pixel = PIXEL_NOISE * 2 / np.sqrt(np.array([b.pixels for b in seen]))
            by_fill = np.maximum(0.0, np.abs(fill - np.median(fill)) - FILL_TOL - pixel) / FILL_TOL
            by_aspect = np.maximum(0.0, np.abs(aspect - np.median(aspect)) - ASPECT_TOL - pixel) / ASPECT_TOL
            excess = by_fill + by_aspect
            if excess.sum() > 0:
                k = int(np.argmax(excess))
                frame = int(np.flatnonzero(found)[k])
                what = (f"fill {np.median(fill):.2f} → {fill[k]:.2f}" if by_fill[k] >= by_aspect[k] else
                        f"aspect {math.exp(np.median(aspect)):.2f} → {math.exp(aspect[k]):.2f}")
                findings.append(Finding(SHAPE_WEIGHT * float(excess.sum()), frame,
                                    f"{t.label} changes shape at frame {frame} ({what})"))
    for a, b, f in swapped:
        findings.append(Finding(SWAP_WEIGHT, f, f"{a.label} and {b.label} swap identity at frame {f}"))
    return Dimension.of(findings)


# --------------------------------------------------------------------------------------------- continuity


def _motion_finding(t: ObjectTrack, starts: np.ndarray, v: np.ndarray, j: int, excess: float) -> Finding:
    """The finding of the acceleration between step ``j`` and ``j + 1`` of track ``t``: a freeze when a moving
    object stalls, else the odd one of the two steps (the one farther from the median speed; the faster one
    of two) named as a jump or a drop, or a turn when their speeds agree."""
    speeds = np.linalg.norm(v, axis=1)
    med = float(np.median(speeds))
    before, after = float(speeds[j]), float(speeds[j + 1])
    penalty = excess / ACC_SCALE
    slow = [k for k in range(len(speeds)) if med >= MOVING and speeds[k] < FREEZE_SHARE * med]

    def freeze(run: tuple[int, int]) -> Finding:
        a, b = int(starts[run[0]]), int(starts[run[1]]) + 1
        return Finding(penalty, a, f"{t.label} freezes from frame {a} to frame {b}, moving before and after",
                     f"{t.index}:freeze:{a}")

    if j in slow or j + 1 in slow:
        return freeze(next(r for r in _runs(slow) if r[0] <= j + 1 and r[1] >= j))
    if len(speeds) > 2 and abs(before - med) != abs(after - med):
        odd = j if abs(before - med) > abs(after - med) else j + 1
    else:
        odd = j if before > after else j + 1
    if odd - 1 in slow and speeds[odd] > med:  # the catch-up after a freeze is part of it
        return freeze(next(r for r in _runs(slow) if r[1] == odd - 1))
    fast, other = float(speeds[odd]), float(speeds[j + 1 if odd == j else j])
    f0 = int(starts[odd])
    f1, key = f0 + 1, f"{t.index}:step:{f0}"
    if fast >= 2 * other and other > 0.005:
        return Finding(penalty, f0, f"{t.label} speed jumps {fast / other:.1f}x between frames {f0} and {f1}", key)
    if fast >= 2 * other:
        return Finding(penalty, f0, f"{t.label} jumps {fast:.2f} of the frame between frames {f0} and {f1}", key)
    if fast <= 0.5 * other:
        return Finding(penalty, f0, f"{t.label} speed drops to {fast / other:.1f}x between frames {f0} and {f1}", key)
    return Finding(penalty, int(starts[j + 1]), f"{t.label} changes direction abruptly at frame {int(starts[j + 1])}")


def continuity(space: MotionSpace, swapped: list[tuple[ObjectTrack, ObjectTrack, int]]) -> Dimension:
    findings: list[Finding] = []
    skip = {(t.index, f) for a, b, f in swapped for t in (a, b)}  # a swap is an identity finding, not a jump
    for t in space.tracks:
        starts, v = t.velocities()
        if len(v) < 2:
            continue
        med = float(np.median(np.linalg.norm(v, axis=1)))
        acc = np.linalg.norm(v[1:] - v[:-1], axis=1)  # between step j and j + 1
        tol = ACC_TOL + ACC_REL * med + PIXEL_NOISE / space.side
        for j in np.flatnonzero(acc > tol):
            frames = {int(starts[j]) + 1, int(starts[j + 1]) + 1}  # the landing frames of both steps
            if any((t.index, f) in skip for f in frames):
                continue
            findings.append(_motion_finding(t, starts, v, int(j), float(acc[j] - tol)))
        idx = np.flatnonzero(t.found)
        la = t.log_areas[idx]
        growth = (la[1:] - la[:-1]) / (idx[1:] - idx[:-1])
        size_tol = SIZE_TOL + PIXEL_NOISE * 2 / math.sqrt(max(1, min(b.pixels for b in t.blobs if b is not None)))
        for j in np.flatnonzero(np.abs(np.diff(growth)) > size_tol):
            f0 = int(idx[j + 1])
            if (t.index, f0 + 1) in skip or (t.index, f0) in skip:
                continue
            ratio = math.exp(growth[j + 1])
            findings.append(Finding((abs(growth[j + 1] - growth[j]) - size_tol) / SIZE_SCALE, f0,
                                f"{t.label} size jumps {max(ratio, 1 / ratio):.1f}x between frames {f0} and {f0 + 1}"))
    return Dimension.of(_merge_motion(findings))


def _merge_motion(findings: list[Finding]) -> list[Finding]:
    """One finding per sentence: the two accelerations of one jump (on and off) name it once, costing both."""
    merged: dict[str, Finding] = {}
    for i in findings:
        key = i.key or i.text
        if key in merged:
            merged[key].penalty += i.penalty
        else:
            merged[key] = Finding(i.penalty, i.frame, i.text, key)
    return list(merged.values())


# --------------------------------------------------------------------------------------------- plausibility


def _expected_area(t: ObjectTrack, clear: np.ndarray) -> np.ndarray:
    """``(F,)`` the area ``t`` would have in each frame, interpolated (in log) over the ``clear`` frames."""
    idx = np.flatnonzero(t.found & clear)
    if not len(idx):
        idx = np.flatnonzero(t.found)
    return np.exp(np.interp(np.arange(len(t.blobs)), idx, t.log_areas[idx]))


def _box_share(a: tuple[float, ...], b: tuple[float, ...]) -> float:
    w = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    h = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    small = min((a[2] - a[0]) * (a[3] - a[1]), (b[2] - b[0]) * (b[3] - b[1]))
    return float(w * h / small) if small > 0 else 0.0


def _near(a, b) -> bool:
    """Two blobs that may be in each other: their boxes intersect, or their masks come within 2 px (the
    seam of two colours can be read as neither, so touching masks need not be adjacent)."""
    if _box_share(a.box, b.box) > 0:
        return True
    return bool((ndimage.binary_dilation(a.mask, iterations=2) & b.mask).any())


def plausibility(space: MotionSpace) -> Dimension:
    n = space.num_frames
    tracks = [t for t in space.tracks if t.found.any()]
    contact: dict[tuple[int, int], dict[int, float]] = {}
    near = {t.index: np.zeros(n, dtype=bool) for t in tracks}
    for i, a in enumerate(tracks):
        for b in tracks[i + 1 :]:
            for f in range(n):
                ba, bb = a.blobs[f], b.blobs[f]
                if ba is not None and bb is not None and _near(ba, bb):
                    near[a.index][f] = near[b.index][f] = True
                    contact.setdefault((a.index, b.index), {})[f] = _box_share(ba.box, bb.box)
    expected = {t.index: _expected_area(t, ~near[t.index]) for t in tracks}
    by_index = {t.index: t for t in tracks}
    for (ia, ib), frames in contact.items():
        for f in frames:
            # the share of each one's expected area that is hidden, beyond what pixel quantisation explains
            hidden = [max(0.0, 1.0 - b.area / expected[k][f] - PIXEL_NOISE * 2 / math.sqrt(b.pixels))
                      for k in (ia, ib) for b in [by_index[k].blobs[f]]]
            frames[f] = min(1.0, max(frames[f], *hidden))
    for t in tracks:  # wholly hidden: missing where its path runs inside another object's box
        for f in np.flatnonzero(~t.found):
            hider = _hider(space, t, int(f))
            if hider is not None and hider.found.any():
                key = (min(t.index, hider.index), max(t.index, hider.index))
                contact.setdefault(key, {})[int(f)] = 1.0
    worst = np.zeros(n)
    for frames in contact.values():
        for f, overlap in frames.items():
            worst[f] = max(worst[f], overlap)
    findings = []
    for (ia, ib), frames in contact.items():
        if not any(frames.values()):
            continue
        a, b = space.tracks[ia], space.tracks[ib]
        # the faster one is the subject: it moves into the other
        speed = {t.index: float(np.median(np.linalg.norm(t.velocities()[1], axis=1))) if len(t.velocities()[1]) else 0.0
                 for t in (a, b)}
        mover, other = (a, b) if speed[a.index] >= speed[b.index] else (b, a)
        hit = sorted(f for f, o in frames.items() if o > 0)
        # a frame's cost goes to the pair that overlaps most there (so three objects in one frame cost once)
        cost = sum(worst[f] for f in hit if frames[f] >= worst[f]) / OVERLAP_SCALE
        span = f"frame {hit[0]}" if len(hit) == 1 else f"frames {hit[0]}-{hit[-1]}"
        findings.append(Finding(cost, hit[0], f"{mover.label} passes through {other.label} in {span} "
                                          f"(overlap {max(frames.values()):.0%})"))
    return Dimension.of(findings)


def diagnose(space: MotionSpace) -> dict[str, Dimension]:
    """The three dimensions of a clip's motion space."""
    swapped = swaps(space)
    return {"consistency": consistency(space, swapped), "continuity": continuity(space, swapped),
            "plausibility": plausibility(space)}
