"""Anti-aliased renderer of motion tasks: each frame is a VVR scene at its time.

Frame ``f`` of ``F`` shows every object visible at ``t = f / (F - 1)`` at its interpolated box, painted
with VVR's shape rasteriser on a supersampled canvas and box-reduced, exactly as ``rewards.vvr.render``
paints a still scene (so per-frame segmentation sees the anti-aliasing it was built for). A
9×64×64 clip takes about 1-2 ms.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np
from PIL import Image, ImageDraw

from rewards.vvr.geometry import STROKE, draw_shape
from rewards.vvr.palette import PALETTE
from rewards.vvr.render import MAX_CANVAS, SUPERSAMPLE
from rewards.vvr_motion.tasks import MotionTask, as_task


def frame_times(num_frames: int) -> np.ndarray:
    """``(F,)`` times in [0, 1] of the frames of an ``F``-frame clip (first frame 0, last frame 1)."""
    return np.linspace(0.0, 1.0, num_frames)


def render(task: MotionTask | Mapping[str, Any], size: int = 64, num_frames: int | None = None) -> np.ndarray:
    """The task as a clip ``(F, size, size, 3)`` uint8; ``F`` is ``num_frames`` or the task's own."""
    task = as_task(task)
    k = max(1, min(SUPERSAMPLE, MAX_CANVAS // size))
    canvas = size * k
    frames = []
    for t in frame_times(num_frames or task.num_frames):
        img = Image.new("RGB", (canvas, canvas), PALETTE[task.background])
        draw = ImageDraw.Draw(img)
        for obj in task.objects:
            if not obj.visible(t):
                continue
            b = obj.box(t)
            box = ((b.cx - b.w / 2) * canvas, (b.cy - b.h / 2) * canvas,
                   (b.cx + b.w / 2) * canvas, (b.cy + b.h / 2) * canvas)
            draw_shape(draw, obj.start.shape, box, PALETTE[obj.start.colour],
                       None if obj.start.filled else STROKE * canvas)
        frames.append(np.asarray(img.reduce(k) if k > 1 else img))
    return np.stack(frames)
