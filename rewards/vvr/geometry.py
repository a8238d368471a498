"""Shape outlines shared by the renderer and the verifier's shape templates.

Every shape is upright and described inside its own bounding box: a polygon with vertices in
``[-0.5, 0.5]²`` box coordinates (x to the right, y down), or an ellipse filling the box. An object's
*extent* is the longer side of its box as a fraction of the image width; the box's aspect (width /
height) is fixed per shape, so extent and shape determine the box.
"""

from __future__ import annotations

import numpy as np
from PIL import Image, ImageDraw

SHAPES: tuple[str, ...] = ("circle", "square", "rectangle", "triangle", "pentagon", "hexagon", "star", "ellipse")
ROUND_SHAPES = frozenset({"circle", "ellipse"})

#: size class → extent (longer box side / image width): small is 12.8 px at 64 px
SIZE_EXTENT: dict[str, float] = {"small": 0.20, "medium": 0.27, "large": 0.36}
#: shapes never drawn small: at 13 px and JPEG-compressed they cannot be told from a circle
NOT_SMALL = frozenset({"hexagon", "pentagon"})
SIZES: tuple[str, ...] = tuple(SIZE_EXTENT)
#: outline stroke width as a fraction of the image width (3.8 px at 64 px: JPEG does not break it)
STROKE = 0.06


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
    "hexagon": _regular(6, -90),  # pointy-top: the only shape taller than wide, never a circle
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


def coverage(shape: str, box: tuple[float, float, float, float], hw: tuple[int, int]) -> np.ndarray:
    """Float ``hw`` map of the fraction of each pixel covered by ``shape`` filling ``box``.

    ``box`` = (x0, y0, x1, y1) in continuous pixel coordinates (pixel ``i`` spans [i, i+1)); the
    coverage is measured on a 4× supersampled raster, the renderer's own anti-aliasing.
    """
    return coverages([(shape, box)], hw)[0]


def coverages(placed: list[tuple[str, tuple[float, float, float, float]]], hw: tuple[int, int]) -> np.ndarray:
    """:func:`coverage` of several (shape, box) placements at once → ``(N, h, w)`` float32.

    They are drawn side by side on one canvas: one allocation and one reduction instead of N.
    """
    ss = 4
    h, w = hw
    img = Image.new("L", (w * ss * len(placed), h * ss), 0)
    draw = ImageDraw.Draw(img)
    for k, (shape, (x0, y0, x1, y1)) in enumerate(placed):
        dx = k * w * ss - 0.5
        # clip to the shape's own panel, so a box reaching past the crop cannot paint its neighbour
        panel = Image.new("L", (w * ss, h * ss), 0) if x0 < 0 or x1 > w else None
        if panel is None:
            draw_shape(draw, shape, (x0 * ss + dx, y0 * ss - 0.5, x1 * ss + dx, y1 * ss - 0.5), 255)
        else:
            draw_shape(ImageDraw.Draw(panel), shape, (x0 * ss - 0.5, y0 * ss - 0.5, x1 * ss - 0.5, y1 * ss - 0.5), 255)
            img.paste(panel, (k * w * ss, 0))
    out = np.asarray(img.reduce(ss), dtype=np.float32) / 255.0
    return out.reshape(h, len(placed), w).transpose(1, 0, 2)


def _moments(shape: str) -> tuple[float, float, float]:
    cov = coverage(shape, (0.0, 0.0, 256.0, 256.0), (256, 256))
    ys, xs = np.indices(cov.shape) + 0.5
    total = cov.sum()
    return float(total / cov.size), float((cov * xs).sum() / total / 256 - 0.5), float((cov * ys).sum() / total / 256 - 0.5)


#: shape → (area / box area, centroid x offset, centroid y offset), offsets in box units from its centre
MOMENTS: dict[str, tuple[float, float, float]] = {s: _moments(s) for s in SHAPES}
