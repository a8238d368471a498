"""The deterministic VVR verifier: image + task → per-constraint pass/fail and the RL reward.

References are resolved by descriptor among the detected objects (``segment``): a relation's reference
must match exactly one object, otherwise its constraint fails; counts count matching objects.
Mask predicates, in working pixels (the image, reduced to at most ``segment.WORK`` = 128 px) [derived
where noted]:

* inside(A, B): ≥ 95 % of A's mask lies in B's hole-filled mask (method page).
* touching(A, B): A's mask dilated by 2 px (3 px from 96 px up) meets B's, and the
  objects' full shapes (matched anti-aliased templates, which include hidden parts) share < 20 % of
  the smaller one [derived from the method page's "IoU < 0.05": relative to the smaller object, so a small
  object lying on a big one is not "touching", and looser, since at 64 px one pixel row is 8-10 % of
  a small object and a fitted template may be a pixel off].
* overlapping(A, B): the full shapes share ≥ 20 % of the smaller one [derived], and neither is inside
  the other (the generator overlaps by ≥ 35 %).

Box predicates (left-of, aligned, between, ...) are in ``predicates`` with the method page's thresholds; size
classes use the box extent (longer side), not the area fraction, so a star and a square of one size
class agree [derived]. Every detected object counts for ``total_count``, ``nearest_to`` and
``extremal`` (which compare against all other objects), whether or not its shape was recognised.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np
import torch
from PIL import Image
from scipy import ndimage

from rewards.vvr import predicates as P
from rewards.vvr.segment import Component, Detection, segment
from rewards.vvr.tasks import Constraint, Task, as_task

GAMMA = 0.5  # weight of the all-or-nothing term in the RL reward (spec, [derived])
CONTACT_SHARE = 0.2  # full shapes sharing less than this of the smaller one touch, more overlap
INSIDE_SHARE = 0.95
MIN_SIDE = 16  # smaller images cannot show 10 px objects


@dataclass
class Verdict:
    """Result of :func:`verify`.

    ``constraints``: ``(type, passed)`` in the task's order; ``score``: ``(1-γ)·mean + γ·all`` in [0, 1];
    ``valid``: False when the image could not be read (then ``score`` is 0 and ``reason`` says why);
    ``detected``: the objects the verifier saw (colour, shape, filled, box (cx, cy, w, h) as image
    fractions), for logs and galleries.
    """

    constraints: list[tuple[str, bool]]
    score: float
    all_passed: bool
    valid: bool = True
    reason: str = ""
    detected: list[dict[str, Any]] = field(default_factory=list)


class _BadImage(Exception):
    pass


def as_array(value: Any) -> np.ndarray | None:
    """A torch tensor (as float32 on the CPU) or numpy array as a numpy array; None for anything else."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", torch.float32).numpy()
    return value if isinstance(value, np.ndarray) else None


def pixels_uint8(arr: np.ndarray) -> np.ndarray | None:
    """``arr`` as uint8 0-255 pixels (floats are [0, 1] images unless they are clearly 0-255 ones); None when a
    value is NaN or infinite. Images here, and the frames of :mod:`rewards.vvr_motion.video`."""
    if arr.dtype == np.uint8:
        return arr
    arr = arr.astype(np.float64)
    if not np.isfinite(arr).all():
        return None
    return np.clip(arr * (255.0 if arr.max() <= 1.0 + 1e-6 else 1.0), 0, 255).round().astype(np.uint8)


def _as_rgb(image: Any) -> np.ndarray:
    """Any accepted image form → ``(H, W, 3)`` uint8, or ``_BadImage`` saying what is wrong."""
    if isinstance(image, Image.Image):
        if image.mode in ("1", "L", "LA", "I", "I;16", "F"):
            raise _BadImage(f"grayscale image (PIL mode {image.mode!r}); expected an RGB image")
        arr = np.asarray(image.convert("RGB"))
    else:
        arr = as_array(image)
        if arr is None:
            raise _BadImage(f"unreadable image of type {type(image).__name__}; expected PIL, numpy or torch")
        if arr.ndim == 3 and arr.shape[0] in (1, 3, 4) and arr.shape[-1] not in (1, 3, 4):
            arr = np.moveaxis(arr, 0, -1)  # channels first, as tensors come
        if arr.ndim == 2 or (arr.ndim == 3 and arr.shape[-1] == 1):
            raise _BadImage(f"grayscale image (shape {tuple(arr.shape)}); expected 3 colour channels")
        if arr.ndim != 3 or arr.shape[-1] not in (3, 4):
            raise _BadImage(f"wrong image shape {tuple(arr.shape)}; expected (H, W, 3) or (3, H, W)")
        arr = pixels_uint8(arr[..., :3])
        if arr is None:
            raise _BadImage("image has NaN or infinite values")
    if min(arr.shape[:2]) < MIN_SIDE:
        raise _BadImage(f"image too small ({arr.shape[1]}x{arr.shape[0]}); need at least {MIN_SIDE} px")
    step = max(1, max(arr.shape[:2]) // 128)  # a strided view is enough to see a blank image
    if np.ptp(arr[::step, ::step].reshape(-1, 3), axis=0).max() < 4:
        raise _BadImage("blank image (a single colour)")
    return arr


def matches(ref: Mapping[str, str], colour: str | None, shape: str | None) -> bool:
    """Whether an object of ``colour``/``shape`` fits a descriptor (it names a colour, a shape, or both)."""
    return ref.get("colour", colour) == colour and ref.get("shape", shape) == shape


class DetectedScene:
    """Detected objects with the lookups the constraint checks need."""

    def __init__(self, det: Detection):
        self.det = det
        self.objs = det.components

    def find(self, ref: Mapping[str, str]) -> list[Component]:
        return [o for o in self.objs if matches(ref, o.colour, o.shape)]

    def one(self, ref: Mapping[str, str]) -> Component | None:
        found = self.find(ref)
        return found[0] if len(found) == 1 else None

    def others(self, *objs: Component) -> list[P.Box]:
        return [o.box for o in self.objs if all(o is not x for x in objs)]


def _share(a: Component, b: Component) -> float:
    """Fraction of the smaller full shape covered by the other's full shape (soft, sub-pixel)."""
    inter = np.minimum(a.template, b.template).sum()
    return float(inter / max(1e-6, min(a.template.sum(), b.template.sum())))


def _inside(a: Component, b: Component) -> bool:
    return np.count_nonzero(a.mask & b.filled_mask) >= INSIDE_SHARE * a.area


def _touching(a: Component, b: Component) -> bool:
    reach = 3 if max(a.mask.shape) >= 96 else 2  # the method page's 2 px at 64 px, a little less than scaled
    ys, xs = np.nonzero(a.mask)
    sl = (slice(max(0, ys.min() - reach), ys.max() + reach + 1), slice(max(0, xs.min() - reach), xs.max() + reach + 1))
    near = ndimage.binary_dilation(a.mask[sl], np.ones((3, 3), bool), iterations=reach)
    return bool((near & b.mask[sl]).any()) and _share(a, b) < CONTACT_SHARE


def _overlapping(a: Component, b: Component) -> bool:
    return _share(a, b) >= CONTACT_SHARE and not _inside(a, b) and not _inside(b, a)


#: pair relations read from the two boxes alone: constraint type → (predicate, whether it takes ``(y, x)``)
_BOX_RELATIONS = {
    "bigger": (P.bigger, False), "left_of": (P.left_of, False), "right_of": (P.left_of, True),
    "above": (P.above, False), "below": (P.above, True),
    "horizontally_aligned": (P.horizontally_aligned, False), "vertically_aligned": (P.vertically_aligned, False),
}


def check(c: Constraint, scene: DetectedScene) -> bool:
    """Whether the detected scene satisfies constraint ``c``."""
    t, a = c.type, c.args
    n_of = lambda ref: len(scene.find(ref))  # noqa: E731
    if t == "exists":
        return n_of(a["ref"]) >= 1
    if t == "absent":
        return n_of(a["ref"]) == 0
    if t in ("count_shape", "count_colour", "count_colour_shape"):
        return n_of({k: a[k] for k in ("colour", "shape") if k in a}) == a["n"]
    if t == "total_count":
        return len(scene.objs) == a["n"]
    if t == "at_least":
        return n_of(a["ref"]) >= a["n"]
    if t == "at_most":
        return n_of(a["ref"]) <= a["n"]
    if t == "more_than":
        return n_of(a["a"]) > n_of(a["b"])
    if t == "equal_count":
        return n_of(a["a"]) == n_of(a["b"])
    if t == "background_colour":
        return scene.det.background == a["colour"]
    refs = [scene.one(a[k]) for k in ("ref", "a", "b", "c") if k in a]
    if any(r is None for r in refs):
        return False  # a referenced object is missing or ambiguous
    x = refs[0]
    y = refs[1] if len(refs) > 1 else None
    if t == "colour_of":
        return x.colour == a["colour"]
    if t == "shape_of":
        return x.shape == a["shape"]
    if t == "size_class":
        return P.size_class(x.box.extent) == a["size"]
    if t == "filled":
        return x.filled == a["filled"]
    if t == "extremal":
        return P.extremal(x.box, scene.others(x), a["direction"])
    if t == "region":
        return P.in_region(x.box, a["region"])
    assert y is not None
    if x is y:
        return False
    if t in _BOX_RELATIONS:
        predicate, swapped = _BOX_RELATIONS[t]
        return predicate(y.box, x.box) if swapped else predicate(x.box, y.box)
    if t in ("same_colour", "different_colour"):  # an unnamed colour is neither the same nor different
        return x.colour is not None and y.colour is not None and (x.colour == y.colour) == (t == "same_colour")
    if t == "same_shape":
        return x.shape is not None and x.shape == y.shape
    if t == "nearest_to":
        return P.nearest_to(x.box, y.box, scene.others(x, y))
    if t == "between":
        z = refs[2]
        return len({id(x), id(y), id(z)}) == 3 and P.between(x.box, y.box, z.box)
    if t == "inside":
        return _inside(x, y)
    if t == "touching":
        return _touching(x, y)
    if t == "overlapping":
        return _overlapping(x, y)
    raise ValueError(f"unknown constraint type {t!r}")


def score(passed: list[bool], gamma: float = GAMMA) -> float:
    """RL reward ``(1-γ)·mean_j s_j + γ·Π_j s_j``."""
    if not passed:
        return 0.0
    return (1 - gamma) * sum(passed) / len(passed) + gamma * float(all(passed))


def verify(task: Task | Mapping[str, Any], image: Any) -> Verdict:
    """Check ``image`` against ``task``.

    ``image``: a PIL image, an ``(H, W, 3)`` uint8 or float [0, 1] numpy array, or a ``(3, H, W)`` float
    tensor in [0, 1]; any size from 16 px (64-1024 px is the intended range). A malformed task raises
    ``ValueError``; an unusable image gives an invalid verdict (score 0, ``reason`` set).
    """
    task = as_task(task)
    try:
        rgb = _as_rgb(image)
    except _BadImage as e:
        return Verdict([(c.type, False) for c in task.constraints], 0.0, False, valid=False, reason=str(e))
    scene = DetectedScene(segment(rgb))
    passed = [bool(check(c, scene)) for c in task.constraints]
    detected = [{"colour": o.colour, "shape": o.shape, "filled": o.filled, "box": tuple(round(float(v), 3) for v in o.box)}
                for o in scene.objs]
    return Verdict([(c.type, p) for c, p in zip(task.constraints, passed)], score(passed), all(passed),
                   detected=detected)
