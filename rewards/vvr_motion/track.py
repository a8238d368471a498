"""Per-frame VVR detection of a clip and the tracks of referenced objects through it.

Each frame is segmented by VVR's verifier (``rewards.vvr.segment``); an object is *found* in a frame
when one detected object matches its descriptor (colour + shape), as VVR resolves references, or when
one match is ``FRAGMENT_RATIO``× larger than every other: at 64 px JPEG can leave a few-pixel blob of
one object's colour at the seam of two neighbours, which is debris, not a second object [derived].
Two comparable matches are ambiguous: not found.
Tracks are read in image fractions (x right, y down), so every threshold built on them scales with the
frame size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from rewards.vvr.predicates import Box
from rewards.vvr.segment import segment
from rewards.vvr.verify import DetectedScene

FRAGMENT_RATIO = 4.0
PERSIST = 0.8  # an object must be found in ≥ this share of the frames it should be in
#: a run of this many missed frames (or more) between sightings is a disappearance (flicker), not a
#: missed detection
FLICKER_RUN = 2


def detect(clip: np.ndarray) -> list[DetectedScene]:
    """``(F, H, W, 3)`` uint8 → the VVR scene detected in each frame (about 10 ms a frame)."""
    return [DetectedScene(segment(frame)) for frame in clip]


@dataclass
class Track:
    """Where one descriptor is found in each frame: ``boxes[f]`` is its box (image fractions) or None."""

    ref: Mapping[str, str]
    boxes: list[Box | None]

    @staticmethod
    def follow(ref: Mapping[str, str], scenes: list[DetectedScene]) -> "Track":
        boxes = []
        for scene in scenes:
            matches = sorted(scene.find(ref), key=lambda c: c.area, reverse=True)
            clear = len(matches) == 1 or len(matches) > 1 and matches[0].area >= FRAGMENT_RATIO * matches[1].area
            boxes.append(matches[0].box if clear else None)
        return Track(ref, boxes)

    @property
    def found(self) -> np.ndarray:
        """``(F,)`` bool: found in each frame."""
        return np.array([b is not None for b in self.boxes])

    def first(self) -> int | None:
        """Index of the first frame the object is found in (None: never)."""
        idx = np.flatnonzero(self.found)
        return int(idx[0]) if len(idx) else None

    def steady(self, start: int = 0) -> bool:
        """Persistent and not flickering from frame ``start`` on: found in ≥ ``PERSIST`` of those frames,
        never missed ``FLICKER_RUN`` frames in a row, and the same colour + shape throughout (a frame
        where it changed colour or shape does not match its descriptor, so it counts as missed)."""
        found = self.found[start:]
        if len(found) == 0 or found.mean() < PERSIST:
            return False
        run = longest = 0
        for f in found:
            run = 0 if f else run + 1
            longest = max(longest, run)
        return longest < FLICKER_RUN

    def points(self, frames: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(frame indices ``(K,)``, centres ``(K, 2)``, box areas ``(K,)``) of the frames it is found in
        (restricted to ``frames``, a ``(F,)`` bool mask, when given)."""
        keep = self.found if frames is None else self.found & frames
        idx = np.flatnonzero(keep)
        boxes = [self.boxes[i] for i in idx]
        centres = np.array([(b.cx, b.cy) for b in boxes], dtype=np.float64).reshape(-1, 2)
        areas = np.array([b.w * b.h for b in boxes], dtype=np.float64)
        return idx, centres, areas

    def extent(self) -> float:
        """Median box extent (longer side, image fractions) over the frames it is found in; 0 if none."""
        ext = [b.extent for b in self.boxes if b is not None]
        return float(np.median(ext)) if ext else 0.0

    def summary(self) -> dict[str, Any]:
        """For verdicts and galleries: found per frame ("1"/"0") and the rounded centres and areas."""
        return {
            "ref": dict(self.ref),
            "found": "".join("1" if b is not None else "0" for b in self.boxes),
            "centre": [None if b is None else (round(float(b.cx), 3), round(float(b.cy), 3)) for b in self.boxes],
            "area": [None if b is None else round(float(b.w * b.h), 4) for b in self.boxes],
        }
