"""Anti-aliased PIL renderer of VVR scenes.

Objects are painted in list order (later ones on top) on a canvas ``SUPERSAMPLE``× larger, which is then
box-averaged down (``Image.reduce``): every output pixel is the exact area-weighted mix of the colours
under it, which is the anti-aliasing model the verifier's segmentation assumes. Box reduction is also
several times faster than a LANCZOS resize (about 0.3 ms for a 64 px scene).
"""

from __future__ import annotations

from typing import Any, Mapping

from PIL import Image, ImageDraw

from rewards.vvr.geometry import STROKE, draw_shape
from rewards.vvr.palette import PALETTE
from rewards.vvr.tasks import Obj, Task, as_task

SUPERSAMPLE = 4
# the supersampled canvas is capped so that 512-1024 px renders stay fast (≥ 2× supersampling there)
MAX_CANVAS = 2048


def object_box(obj: Obj, size: float) -> tuple[float, float, float, float]:
    """(x0, y0, x1, y1) of ``obj``'s shape box in pixels of a ``size``-px canvas."""
    b = obj.box
    return ((b.cx - b.w / 2) * size, (b.cy - b.h / 2) * size, (b.cx + b.w / 2) * size, (b.cy + b.h / 2) * size)


def render(task: Task | Mapping[str, Any], size: int = 128) -> Image.Image:
    """The task's scene as a ``size``×``size`` RGB image."""
    task = as_task(task)
    k = max(1, min(SUPERSAMPLE, MAX_CANVAS // size))
    canvas = size * k
    img = Image.new("RGB", (canvas, canvas), PALETTE[task.background])
    draw = ImageDraw.Draw(img)
    for obj in task.objects:
        draw_shape(draw, obj.shape, object_box(obj, canvas), PALETTE[obj.colour],
                   None if obj.filled else STROKE * canvas)
    return img.reduce(k) if k > 1 else img
