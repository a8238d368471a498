"""Shape outlines shared by the renderer and the verifier's shape templates.

Every shape is upright and described inside its own bounding box: a polygon with vertices in
``[-0.5, 0.5]²`` box coordinates (x to the right, y down), or an ellipse filling the box. An object's
*extent* is the longer side of its box as a fraction of the image width; the box's aspect (width /
height) is fixed per shape, so extent and shape determine the box.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
from PIL import Image, ImageDraw

SHAPES: tuple[str, ...] = ("circle", "square", "rectangle", "triangle", "pentagon", "hexagon", "star", "ellipse")
ROUND_SHAPES = frozenset({"circle", "ellipse"})

#: size class → extent (longer box side / image width); ≥ 10 px at 64 px
SIZE_EXTENT: dict[str, float] = {"small": 0.16, "medium": 0.24, "large": 0.34}
SIZES: tuple[str, ...] = tuple(SIZE_EXTENT)
#: outline stroke width as a fraction of the image width (≥ 2.5 px at 64 px, so it survives 3×3 opening)
STROKE = 0.04


def _regular(n: int, start_deg: float, radii: tuple[float, ...] = (1.0,)) -> np.ndarray:
    k = n * len(radii)
    ang = np.radians(start_deg + 360.0 * np.arange(k) / k)
    r = np.array(radii * n)
    return np.stack([r * np.cos(ang), r * np.sin(ang)], 1)


def _to_box(v: np.ndarray) -> np.ndarray:
    lo, hi = v.min(0), v.max(0)
    return (v - (lo + hi) / 2) / (hi - lo)


# raw vertices (y grows downwards, so -90° points up); boxes are normalised below
_RAW: dict[str, np.ndarray] = {
    "square": np.array([[0.0, 0.0], [1.0, 0.0], [1.0, 1.0], [0.0, 1.0]]),
    "rectangle": np.array([[0.0, 0.0], [1.6, 0.0], [1.6, 1.0], [0.0, 1.0]]),
    "triangle": _regular(3, -90),
    "pentagon": _regular(5, -90),
    "hexagon": _regular(6, 0),
    # inner radius 0.5 (a regular pentagram has 0.38): fatter arms stay visible at 10 px
    "star": _regular(5, -90, (1.0, 0.5)),
}
_POLYGONS: dict[str, np.ndarray] = {s: _to_box(v) for s, v in _RAW.items()}


def _aspect(shape: str) -> float:
    if shape in ROUND_SHAPES:
        return 1.6 if shape == "ellipse" else 1.0
    span = _RAW[shape].max(0) - _RAW[shape].min(0)
    return float(span[0] / span[1])


#: canonical box aspect (width / height) of each shape as rendered
ASPECT: dict[str, float] = {s: _aspect(s) for s in SHAPES}


def box_size(shape: str, extent: float) -> tuple[float, float]:
    """(width, height) of the shape's box for a given extent (same unit as ``extent``)."""
    a = ASPECT[shape]
    return (extent, extent / a) if a >= 1 else (extent * a, extent)


def draw_shape(
    draw: ImageDraw.ImageDraw,
    shape: str,
    box: tuple[float, float, float, float],
    fill: tuple[int, int, int] | int,
    stroke: float | None = None,
) -> None:
    """Paint ``shape`` filling ``box`` = (x0, y0, x1, y1) in pixels; ``stroke`` px draws an outline only."""
    x0, y0, x1, y1 = box
    width = None if stroke is None else max(1, round(stroke))
    if shape in ROUND_SHAPES:
        if width is None:
            draw.ellipse(box, fill=fill)
        else:
            draw.ellipse(box, outline=fill, width=width)
        return
    v = _POLYGONS[shape]
    pts = [((x0 + x1) / 2 + vx * (x1 - x0), (y0 + y1) / 2 + vy * (y1 - y0)) for vx, vy in v]
    if width is None:
        draw.polygon(pts, fill=fill)
    else:
        draw.polygon(pts, outline=fill, width=width)


@lru_cache(maxsize=8192)
def template(shape: str, h: int, w: int) -> np.ndarray:
    """Boolean ``(h, w)`` mask of ``shape`` stretched to fill an h×w pixel box (cached; read-only)."""
    ss = 4  # supersample, then keep pixels at least half covered
    img = Image.new("L", (w * ss, h * ss), 0)
    draw_shape(ImageDraw.Draw(img), shape, (0, 0, w * ss - 1, h * ss - 1), 255)
    mask = np.asarray(img.reduce(ss)) >= 128
    mask.setflags(write=False)
    return mask
