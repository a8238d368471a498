"""Box-level spatial predicates shared by the task generator and the verifier.

Positions are image fractions (x right, y down, both in [0, 1]); ``w``/``h`` are box sizes in the same
unit. The verifier calls these with the method page's thresholds (the defaults); the generator calls them with
stricter margins, so a constraint it emits holds with room to spare after blur, JPEG and resizing.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence

from rewards.vvr.geometry import SIZE_EXTENT


class Box(NamedTuple):
    """An object's box: centre ``(cx, cy)`` and size ``(w, h)``, all image fractions."""

    cx: float
    cy: float
    w: float
    h: float

    @property
    def extent(self) -> float:
        return max(self.w, self.h)


# size class boundaries halfway (geometrically) between the rendered extents
SMALL_MEDIUM = math.sqrt(SIZE_EXTENT["small"] * SIZE_EXTENT["medium"])
MEDIUM_LARGE = math.sqrt(SIZE_EXTENT["medium"] * SIZE_EXTENT["large"])


def size_class(extent: float) -> str:
    """Size class of a box extent (longer side / image width)."""
    return "small" if extent < SMALL_MEDIUM else "medium" if extent < MEDIUM_LARGE else "large"


def left_of(a: Box, b: Box, k: float = 0.1) -> bool:
    """Spec: c_x,A < c_x,B − k·(w_A + w_B)."""
    return a.cx < b.cx - k * (a.w + b.w)


def above(a: Box, b: Box, k: float = 0.1) -> bool:
    """The vertical analogue of :func:`left_of` (y grows downwards)."""
    return a.cy < b.cy - k * (a.h + b.h)


def horizontally_aligned(a: Box, b: Box, tol: float = 0.05) -> bool:
    """Centres on one horizontal line: |Δc_y| < tol (a fraction of the image height)."""
    return abs(a.cy - b.cy) < tol


def vertically_aligned(a: Box, b: Box, tol: float = 0.05) -> bool:
    """Centres on one vertical line: |Δc_x| < tol."""
    return abs(a.cx - b.cx) < tol


def bigger(a: Box, b: Box, ratio: float = 1.15) -> bool:
    """A's extent exceeds B's by ``ratio`` (the size classes are ≥ 1.33× apart)."""
    return a.extent > ratio * b.extent


def between(a: Box, b: Box, c: Box, margin: float = 0.15, band: float = 0.25) -> bool:
    """A lies on the way from B to C [derived]: its centre projects onto segment BC at a fraction in
    (margin, 1 − margin) of its length, within ``band``·|BC| of the line (either order of B and C)."""
    dx, dy = c.cx - b.cx, c.cy - b.cy
    length2 = dx * dx + dy * dy
    if length2 == 0:
        return False
    px, py = a.cx - b.cx, a.cy - b.cy
    t = (px * dx + py * dy) / length2
    off = abs(px * dy - py * dx) / math.sqrt(length2)
    return margin < t < 1 - margin and off < band * math.sqrt(length2)


def _dist(a: Box, b: Box) -> float:
    return math.hypot(a.cx - b.cx, a.cy - b.cy)


def nearest_to(a: Box, b: Box, others: Sequence[Box], ratio: float = 1.0) -> bool:
    """B is the object nearest to A: d(A,B) < ratio·d(A,X) for every other object X."""
    return all(_dist(a, b) < ratio * _dist(a, x) for x in others)


def extremal(a: Box, others: Sequence[Box], direction: str, k: float = 0.1) -> bool:
    """A is left-/right-/top-/bottom-most: beyond every other object by the left-of margin."""
    test = {
        "leftmost": lambda x: left_of(a, x, k),
        "rightmost": lambda x: left_of(x, a, k),
        "topmost": lambda x: above(a, x, k),
        "bottommost": lambda x: above(x, a, k),
    }[direction]
    return all(test(x) for x in others)


def in_region(a: Box, region: str, margin: float = 0.0) -> bool:
    """A's centre lies in the named quadrant, at least ``margin`` from both midlines."""
    vertical, horizontal = region.split("-")
    dy = 0.5 - a.cy if vertical == "top" else a.cy - 0.5
    dx = 0.5 - a.cx if horizontal == "left" else a.cx - 0.5
    return dx > margin and dy > margin
