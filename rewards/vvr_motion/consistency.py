"""Temporal consistency of a clip: do the objects keep their identity from frame to frame? No task needed.

Every frame is segmented as in VVR. Between consecutive frames, objects are matched one-to-one
(greedily, nearest centres first) when they have the same recognised colour and shape and are
continuous: centres at most ``MAX_JUMP`` apart or masks overlapping with IoU ≥ ``MIN_IOU``. A pair of
frames scores ``matches / max(objects in either frame)`` (1 when neither holds an object); the clip
scores the mean over its ``F - 1`` pairs, in [0, 1]. An object that flickers, changes colour or shape,
teleports, or is not recognisable as a VVR shape costs the pairs it touches; an object that appears
costs the one pair it appears in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rewards.vvr.verify import DetectedScene
from rewards.vvr_motion.track import detect
from rewards.vvr_motion.video import BadVideo, as_clip

#: largest centre move between consecutive frames (image fractions) of one object: 9-frame motion
#: tasks move ≤ 0.06 a frame, so this allows fast motion but not a jump across the frame
MAX_JUMP = 0.15
MIN_IOU = 0.3  # or: masks this similar (an object growing fast in place)


@dataclass
class Consistency:
    """``score`` in [0, 1]; ``pairs``: the ``(F-1,)`` per-pair scores; ``valid`` False (score 0) with a
    ``reason`` when the clip cannot be read."""

    score: float
    valid: bool = True
    reason: str = ""
    pairs: list[float] = field(default_factory=list)


def pair_score(a: DetectedScene, b: DetectedScene) -> float:
    """Share of objects matched between two consecutive frames (see the module docstring)."""
    if not a.objs and not b.objs:
        return 1.0
    candidates = []
    for i, x in enumerate(a.objs):
        for j, y in enumerate(b.objs):
            if x.colour is None or x.shape is None or (x.colour, x.shape) != (y.colour, y.shape):
                continue
            dist = math.hypot(x.box.cx - y.box.cx, x.box.cy - y.box.cy)
            union = np.count_nonzero(x.mask | y.mask)
            iou = np.count_nonzero(x.mask & y.mask) / union if union else 0.0
            if dist <= MAX_JUMP or iou >= MIN_IOU:
                candidates.append((dist, i, j))
    used_a: set[int] = set()
    used_b: set[int] = set()
    for _, i, j in sorted(candidates):
        if i not in used_a and j not in used_b:
            used_a.add(i)
            used_b.add(j)
    return len(used_a) / max(len(a.objs), len(b.objs))


def temporal_consistency(video: Any) -> Consistency:
    """Score a clip (any form ``video.as_clip`` accepts); an unreadable one is invalid, never raises."""
    try:
        clip = as_clip(video)
    except BadVideo as e:
        return Consistency(0.0, False, str(e))
    scenes = detect(clip)
    pairs = [pair_score(a, b) for a, b in zip(scenes, scenes[1:])]
    return Consistency(float(np.mean(pairs)), pairs=pairs)
