"""Motion space: the clip's moving objects as tracks of position, velocity, size and appearance.

An object is a colour (the VVR scenes give every object its own): its track holds, per frame, the
largest blob of that colour (``segment.Blob``) or nothing. From the tracks come the motion-aware
quantities the three dimensions read: centres ``(F, 2)``, per-frame velocities over the frames where it
is seen (a gap of ``g`` frames divides its displacement by ``g``), accelerations, log-areas, and the shape
descriptors ``fill`` and ``aspect``. A second blob of the same colour at least ``SPLIT_SHARE`` of the
first's size is recorded as a split (one object seen as two pieces, or a duplicate).

The objects are the *designated* ones: the colours of a motion task's objects when the sample has one
(each from the frame it should be visible on), else every colour seen in at least ``MIN_SIGHTINGS``
frames (from its first sighting on: an object may appear).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rewards.motion_insight.segment import Blob, clip_blobs

SPLIT_SHARE = 0.3
MIN_SIGHTINGS = 2


@dataclass
class ObjectTrack:
    """One designated object through the clip: ``blobs[f]`` is its blob in frame ``f`` or None;
    ``expected_from`` the first frame it should be seen in; ``splits`` the frames where a second piece
    of its colour shows."""

    index: int
    colour: str
    blobs: list[Blob | None]
    expected_from: int = 0
    splits: list[int] = field(default_factory=list)
    name: str = ""

    @property
    def label(self) -> str:
        """How causes name it: ``object 2 (blue square)`` (numbered from 1, in the order of designation)."""
        return f"object {self.index + 1} ({self.name or self.colour})"

    @property
    def found(self) -> np.ndarray:
        """``(F,)`` bool."""
        return np.array([b is not None for b in self.blobs])

    @property
    def centres(self) -> np.ndarray:
        """``(F, 2)`` image fractions, NaN where not found."""
        return np.array([b.centre if b is not None else (math.nan, math.nan) for b in self.blobs], dtype=np.float64)

    @property
    def log_areas(self) -> np.ndarray:
        """``(F,)`` log of the area (image fractions), NaN where not found."""
        return np.array([math.log(b.area) if b is not None else math.nan for b in self.blobs])

    def velocities(self) -> tuple[np.ndarray, np.ndarray]:
        """(``(K,)`` the frame each step starts at, ``(K, 2)`` per-frame velocity) between successive
        sightings (a gap's displacement shared over its frames)."""
        idx = np.flatnonzero(self.found)
        if len(idx) < 2:
            return np.zeros(0, dtype=int), np.zeros((0, 2))
        c = self.centres[idx]
        return idx[:-1], (c[1:] - c[:-1]) / (idx[1:] - idx[:-1])[:, None]

    def box_at(self, f: int) -> tuple[float, float, float, float] | None:
        b = self.blobs[f]
        return None if b is None else b.box

    def interpolated_centre(self, f: int) -> tuple[float, float] | None:
        """Where the object would be at frame ``f`` between its nearest sightings (None outside them)."""
        idx = np.flatnonzero(self.found)
        before, after = idx[idx < f], idx[idx > f]
        if not len(before) or not len(after):
            return None
        a, b = before[-1], after[0]
        w = (f - a) / (b - a)
        ca, cb = np.array(self.blobs[a].centre), np.array(self.blobs[b].centre)
        return tuple(ca + w * (cb - ca))


@dataclass
class MotionSpace:
    """The designated objects' tracks in a clip of ``num_frames`` frames of ``side`` px (the shorter side)."""

    tracks: list[ObjectTrack]
    num_frames: int
    side: int = 64


def _task_objects(task: Any) -> list[tuple[str, str, float]] | None:
    """(colour, "colour shape", appear time) of each object of a motion task (object or dict), or None."""
    if task is None:
        return None
    objs = task.get("objects") if isinstance(task, Mapping) else getattr(task, "objects", None)
    if not objs:
        return None
    out = []
    for o in objs:
        if isinstance(o, Mapping):
            out.append((str(o.get("colour")), f"{o.get('colour')} {o.get('shape')}", float(o.get("appear", 0.0))))
        else:
            out.append((o.start.colour, f"{o.start.colour} {o.start.shape}", float(o.appear)))
    return out


def build(clip: np.ndarray, task: Any = None) -> MotionSpace:
    """``(F, H, W, 3)`` uint8 clip (and its motion task, when known) → its :class:`MotionSpace`."""
    frames = clip_blobs(clip)
    n = len(frames)
    by_colour: dict[str, list[list[Blob]]] = {}
    for f, blobs in enumerate(frames):
        for b in blobs:
            by_colour.setdefault(b.colour, [[] for _ in range(n)])[f].append(b)
    designated = _task_objects(task)
    if designated is None:
        seen = [(c, sum(1 for fb in per if fb)) for c, per in by_colour.items()]
        # first sighting order: objects are numbered as they show up
        colours = sorted((c for c, k in seen if k >= MIN_SIGHTINGS),
                         key=lambda c: next(f for f, fb in enumerate(by_colour[c]) if fb))
        designated = [(c, c, None) for c in colours]
    tracks = []
    for i, (colour, name, appear) in enumerate(designated):
        per = by_colour.get(colour, [[] for _ in range(n)])
        chosen = [max(fb, key=lambda b: b.area) if fb else None for fb in per]
        splits = [f for f, fb in enumerate(per) if len(fb) > 1
                  and sorted((b.area for b in fb), reverse=True)[1] >= SPLIT_SHARE * max(b.area for b in fb)]
        if appear is None:  # no task: expected from its first sighting
            start = next((f for f, b in enumerate(chosen) if b is not None), n)
        else:  # frame f is at t = f / (n - 1); a frame exactly at the appear time shows the object
            start = math.ceil(appear * (n - 1) - 1e-9)
        tracks.append(ObjectTrack(i, colour, chosen, start, splits, name))
    return MotionSpace(tracks, n, int(min(clip.shape[1:3])))
