"""Known motion defects injected into rendered VVR motion clips: what the diagnosis is measured against.

Each injector takes a motion task and returns ``(clip (F, H, W, 3) uint8, description)`` or None when
the task cannot hold that defect (a swap needs two objects). Frames are spliced from renders of edited
tasks, so every frame stays a clean VVR frame and only the motion is wrong:

* ``drop``: one object is missing from 1-2 frames in the middle of the clip, then returns;
* ``teleport``: from a frame on, one object is shifted by 0.2-0.3 of the frame (and moves on from there);
* ``swap``: from a frame on, two objects exchange colour and shape (each goes on along the other's path);
* ``freeze``: 1-2 frames repeat the frame before them, then the clip goes on on schedule (stall, catch up);
* ``interpenetration``: an object's path is bent to run through another object's centre (and on beyond it).

``DEFECT_DIMENSION`` says which dimension each defect belongs to and ``DEFECT_WORDS`` the words a cause
must hold to name it.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import replace

import numpy as np

from rewards.vvr.scene import EDGE
from rewards.vvr_motion.render import render
from rewards.vvr_motion.tasks import MotionObj, MotionTask

DEFECT_DIMENSION: dict[str, str] = {
    "drop": "consistency",
    "swap": "consistency",
    "teleport": "continuity",
    "freeze": "continuity",
    "interpenetration": "plausibility",
}
DEFECT_WORDS: dict[str, str] = {
    "drop": "disappears",
    "swap": "swap",
    "teleport": "jumps",
    "freeze": "freezes",
    "interpenetration": "passes through",
}
DEFECTS: tuple[str, ...] = tuple(DEFECT_DIMENSION)


def _fits(o: MotionObj) -> bool:
    """The object's box keeps ``EDGE`` from every border at both ends (so throughout: it moves linearly)."""
    return all(EDGE <= b.cx - b.w / 2 and b.cx + b.w / 2 <= 1 - EDGE and EDGE <= b.cy - b.h / 2
               and b.cy + b.h / 2 <= 1 - EDGE for b in (o.box(0.0), o.box(1.0)))


def _with(task: MotionTask, k: int, obj: MotionObj | None) -> MotionTask:
    objs = list(task.objects)
    if obj is None:
        del objs[k]
    else:
        objs[k] = obj
    return replace(task, objects=tuple(objs))


def _middle(rng: random.Random, frames: int, length: int) -> int:
    return rng.randint(2, frames - 2 - length)


def drop(task: MotionTask, rng: random.Random, size: int) -> tuple[np.ndarray, str] | None:
    clip = render(task, size)
    k = rng.randrange(len(task.objects))
    obj = task.objects[k]
    f0 = max(int(np.ceil(obj.appear * (task.num_frames - 1))) + 1, _middle(rng, task.num_frames, 2))
    length = rng.choice([1, 2])
    if f0 + length > task.num_frames - 1:
        return None
    without = render(_with(task, k, None), size)
    clip[f0 : f0 + length] = without[f0 : f0 + length]
    return clip, f"object {k + 1} dropped from frames {f0}-{f0 + length - 1}"


def teleport(task: MotionTask, rng: random.Random, size: int) -> tuple[np.ndarray, str] | None:
    k = rng.randrange(len(task.objects))
    obj = task.objects[k]
    for _ in range(50):
        dist = rng.uniform(0.2, 0.3)
        angle = rng.uniform(0, 2 * np.pi)
        dx, dy = dist * np.cos(angle), dist * np.sin(angle)
        moved = replace(obj, start=replace(obj.start, x=obj.start.x + dx, y=obj.start.y + dy),
                        end_x=obj.end_x + dx, end_y=obj.end_y + dy)
        if not _fits(moved):
            continue
        f0 = max(int(np.ceil(obj.appear * (task.num_frames - 1))) + 1, _middle(rng, task.num_frames, 1))
        clip = render(task, size)
        clip[f0:] = render(_with(task, k, moved), size)[f0:]
        return clip, f"object {k + 1} shifted by {dist:.2f} from frame {f0}"
    return None


def swap(task: MotionTask, rng: random.Random, size: int) -> tuple[np.ndarray, str] | None:
    if len(task.objects) < 2:
        return None
    i, j = rng.sample(range(len(task.objects)), 2)
    a, b = task.objects[i], task.objects[j]
    look = lambda o, other: replace(o, start=replace(o.start, colour=other.start.colour, shape=other.start.shape))
    swapped = _with(_with(task, i, look(a, b)), j, look(b, a))
    first = int(np.ceil(max(a.appear, b.appear) * (task.num_frames - 1)))
    f0 = max(first + 1, _middle(rng, task.num_frames, 1))
    if f0 > task.num_frames - 2:
        return None
    clip = render(task, size)
    clip[f0:] = render(swapped, size)[f0:]
    return clip, f"objects {i + 1} and {j + 1} swap colour and shape from frame {f0}"


def freeze(task: MotionTask, rng: random.Random, size: int) -> tuple[np.ndarray, str] | None:
    clip = render(task, size)
    length = rng.choice([1, 2])
    f0 = _middle(rng, task.num_frames, length)
    clip[f0 : f0 + length] = clip[f0 - 1]
    return clip, f"frames {f0}-{f0 + length - 1} repeat frame {f0 - 1}"


def interpenetration(task: MotionTask, rng: random.Random, size: int) -> tuple[np.ndarray, str] | None:
    if len(task.objects) < 2:
        return None
    order = list(range(len(task.objects)))
    rng.shuffle(order)
    for k in order:  # the mover: bent to pass through another object's centre at t = 0.5
        obj = task.objects[k]
        for m in order:
            other = task.objects[m]
            if m == k or obj.appear > 0 or other.appear > 0:
                continue
            # through the other's centre c, then on by a share s of the way in, as far as the frame allows
            c = other.box(0.5)
            for share in (1.0, 0.8, 0.6, 0.4, 0.25):
                end_x, end_y = c.cx + share * (c.cx - obj.start.x), c.cy + share * (c.cy - obj.start.y)
                bent = replace(obj, end_x=float(end_x), end_y=float(end_y))
                if _fits(bent):
                    return render(_with(task, k, bent), size), f"object {k + 1} runs through object {m + 1}"
    return None


INJECTORS: dict[str, Callable[[MotionTask, random.Random, int], tuple[np.ndarray, str] | None]] = {
    "drop": drop, "teleport": teleport, "swap": swap, "freeze": freeze, "interpenetration": interpenetration,
}


def inject(defect: str, task: MotionTask, seed: int, size: int = 64) -> tuple[np.ndarray, str] | None:
    """``defect`` (one of ``DEFECTS``) injected into ``task``'s clip, deterministically for ``seed``."""
    return INJECTORS[defect](task, random.Random(f"motion_insight:{defect}:{task.id}:{seed}"), size)
