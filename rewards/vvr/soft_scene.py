"""The soft scene behind the ``vvr_soft`` reward: smooth colour masks, counts, centroids and shape reads.

:class:`SoftScene` scores one constraint of a task on one image with differentiable stand-ins for the
verifier's thresholds; ``rewards.vvr.soft`` (the reward) explains the construction.
"""

from __future__ import annotations

import math
from typing import Mapping

import torch

from rewards.vvr.geometry import ASPECT, MOMENTS, SHAPES, SIZE_EXTENT, STROKE, box_size, coverages
from rewards.vvr.palette import COLOURS, PALETTE_LAB, PALETTE_RGB
from rewards.vvr.predicates import MEDIUM_LARGE, SMALL_MEDIUM
from rewards.vvr.segment import ASPECT_WEIGHT, FREE_ASPECT, LUMA_WEIGHTED, placements_by_moments
from rewards.vvr.tasks import Constraint, Obj, Task

KERNEL_POWER = 4  # tail of the colour kernel (larger: sharper, closer to a softmax)
PROFILE_FLOOR = 0.05  # coverage below this is noise to the box's extent (a whole row of it would widen it)
SHAPE_WIDTH = 0.02  # width of the shape margin's smooth step (soft-IoU units)
EM_STEPS = 4  # soft k-means steps that split a colour mask among the scene objects of that colour
EM_SCALE = 0.12  # their spatial scale (image fractions)
WORK = 128  # larger images are average-pooled to at most this many pixels a side (as the verifier)
_LAB = torch.tensor(PALETTE_LAB, dtype=torch.float32)  # (K, 3)
_RGB = torch.tensor(PALETTE_RGB / 255, dtype=torch.float32)  # (K, 3) in [0, 1]
_LUMA = torch.tensor(LUMA_WEIGHTED, dtype=torch.float32)  # the verifier's coverage metric
_INDEX = {c: i for i, c in enumerate(COLOURS)}
# sRGB → XYZ (D65), rows normalised by the white point so XYZ/white is a single matrix product
_M = torch.tensor([[0.4124564, 0.3575761, 0.1804375], [0.2126729, 0.7151522, 0.0721750],
                   [0.0193339, 0.1191920, 0.9503041]]) / torch.tensor([0.95047, 1.0, 1.08883])[:, None]


def srgb_to_lab(rgb: torch.Tensor) -> torch.Tensor:
    """``(B, 3, H, W)`` sRGB in [0, 1] → CIELAB (D65) ``(B, 3, H, W)``, with finite gradients everywhere
    (the power and cube-root branches are clamped away from 0)."""
    c = rgb.clamp(0, 1)
    lin = torch.where(c <= 0.04045, c / 12.92, ((c + 0.055) / 1.055).clamp(min=1e-4) ** 2.4)
    xyz = torch.einsum("ij,bjhw->bihw", _M.to(rgb), lin)
    d = 6 / 29
    f = torch.where(xyz > d**3, xyz.clamp(min=d**3) ** (1 / 3), xyz / (3 * d * d) + 4 / 29)
    return torch.stack([116 * f[:, 1] - 16, 500 * (f[:, 0] - f[:, 1]), 200 * (f[:, 1] - f[:, 2])], 1)


def colour_memberships(images: torch.Tensor, temperature: float) -> torch.Tensor:
    """``(B, 3, H, W)`` in [0, 1] → soft palette memberships ``(B, K, H, W)`` summing to 1 per pixel."""
    lab = srgb_to_lab(images)
    d2 = ((lab[:, None] - _LAB.to(lab)[None, :, :, None, None]) ** 2).sum(2)  # (B, K, H, W)
    # a heavy-tailed (Student-t-like) kernel instead of exp(−d²/τ²): as sharp near a palette centre, but a
    # pixel far from every centre still has a (small) gradient toward each colour instead of exp's underflow
    w = (1 + d2 / temperature**2) ** -KERNEL_POWER
    return w / w.sum(1, keepdim=True)


def object_area(o: Obj) -> float:
    """Fraction of the image ``o`` paints (filled: shape area; outlined: its stroke ring)."""
    w, h = box_size(o.shape, SIZE_EXTENT[o.size])
    full = MOMENTS[o.shape][0] * w * h
    if o.filled:
        return full
    inner = max(0.0, (w - 2 * STROKE) / w) * max(0.0, (h - 2 * STROKE) / h)
    return full * (1 - inner)


def _matches(ref: Mapping[str, str], o: Obj) -> bool:
    return ref.get("colour", o.colour) == o.colour and ref.get("shape", o.shape) == o.shape


class SoftScene:
    """One sample's soft masks plus the task's scene objects, with the soft measurements of descriptors."""

    def __init__(self, image: torch.Tensor, member: torch.Tensor, task: Task, sharpness: float,
                 count_gradients: bool = True, shapes: bool = False):
        self.p, self.task, self.t, self.count_gradients = member, task, sharpness, count_gradients  # p: (K, H, W)
        self.shapes, self.image = shapes, image  # image: (3, H, W) in [0, 1], unmixed by the shape term
        h, w = member.shape[-2:]
        self.ys = (torch.arange(h, dtype=member.dtype, device=member.device) + 0.5) / h
        self.xs = (torch.arange(w, dtype=member.dtype, device=member.device) + 0.5) / w
        objs = task.objects
        self.unit_all = sum(object_area(o) for o in objs) / len(objs) if objs else 0.05
        self.obj_masks = self._object_masks()

    def _object_masks(self) -> list[torch.Tensor]:
        """``(H, W)`` soft mask of each scene object. Objects of a colour no other scene object has take
        the whole colour mask; objects sharing a colour split it by a few soft k-means (EM) steps
        started at the scene's positions [derived]: shape is not measured, so which same-coloured
        blob is "the red star" and which "the red square" is decided by where the scene placed them."""
        masks: list[torch.Tensor | None] = [None] * len(self.task.objects)
        gy, gx = torch.meshgrid(self.ys, self.xs, indexing="ij")
        for colour in {o.colour for o in self.task.objects}:
            idx = [i for i, o in enumerate(self.task.objects) if o.colour == colour]
            if colour == self.task.background:
                for i in idx:
                    masks[i] = torch.zeros_like(self.p[0])
                continue
            w = self.p[_INDEX[colour]]
            if len(idx) == 1:
                masks[idx[0]] = w
                continue
            centres = torch.tensor([[self.task.objects[i].x, self.task.objects[i].y] for i in idx]).to(w)
            for _ in range(EM_STEPS):
                d2 = (gx[None] - centres[:, 0, None, None]) ** 2 + (gy[None] - centres[:, 1, None, None]) ** 2
                resp = torch.softmax(-d2 / (2 * EM_SCALE**2), dim=0) * w  # (m, H, W)
                total = resp.flatten(1).sum(1) + 1e-6
                centres = torch.stack([(resp * gx).flatten(1).sum(1), (resp * gy).flatten(1).sum(1)], 1) / total[:, None]
            for j, i in enumerate(idx):
                masks[i] = resp[j]
        return masks  # type: ignore[return-value]

    def matching(self, ref: Mapping[str, str]) -> list[int]:
        return [i for i, o in enumerate(self.task.objects) if _matches(ref, o)]

    # ------------------------------------------------------------ descriptors
    def colours(self, ref: Mapping[str, str]) -> list[str]:
        if "colour" in ref:
            return [ref["colour"]]
        return sorted({o.colour for o in self.task.objects if _matches(ref, o)})

    def mask(self, ref: Mapping[str, str]) -> torch.Tensor:
        """``(H, W)`` soft mask of the scene objects ``ref`` matches, or of its colour when it matches
        none (0 when there is no colour to read)."""
        found = self.matching(ref)
        if found:
            return torch.stack([self.obj_masks[i] for i in found]).sum(0).clamp(max=1)
        cols = [c for c in self.colours(ref) if c != self.task.background]
        if not cols:
            return torch.zeros_like(self.p[0])
        return self.p[[_INDEX[c] for c in cols]].sum(0).clamp(max=1)

    def mass(self, ref: Mapping[str, str]) -> torch.Tensor:
        return self.mask(ref).mean()

    def unit(self, ref: Mapping[str, str]) -> float:
        areas = [object_area(o) for o in self.task.objects if _matches(ref, o)]
        return sum(areas) / len(areas) if areas else self.unit_all

    def count(self, ref: Mapping[str, str]) -> torch.Tensor:
        """Soft number of objects matching ``ref``: the mass of the matched objects' masks in units of one
        matching object's area; for a descriptor no scene object matches (``absent``), its colour mass
        less the expected area of the scene's objects of that colour."""
        if self.matching(ref):
            return self.mass(ref) / self.unit(ref)
        cols = set(self.colours(ref))
        other = sum(object_area(o) for o in self.task.objects if o.colour in cols and not _matches(ref, o))
        return (self.mass(ref) - other).clamp(min=0) / self.unit(ref)

    def centroid(self, ref: Mapping[str, str]) -> torch.Tensor:
        """Mass-weighted ``(x, y)`` in image fractions; drifts to the centre when the mask is empty."""
        m = self.mask(ref)
        eps = 0.05 * self.unit(ref) * m.numel()  # a twentieth of an object's pixels, at the image centre
        total = m.sum() + eps
        cx = ((m.sum(0) * self.xs).sum() + 0.5 * eps) / total
        cy = ((m.sum(1) * self.ys).sum() + 0.5 * eps) / total
        found = self.matching(ref)
        if len(found) == 1:  # the verifier compares box centres: a triangle's mass sits below its box's
            o = self.task.objects[found[0]]
            w, h = box_size(o.shape, SIZE_EXTENT[o.size])
            cx, cy = cx - MOMENTS[o.shape][1] * w, cy - MOMENTS[o.shape][2] * h
        return torch.stack([cx, cy])

    def box(self, ref: Mapping[str, str]) -> tuple[float, float]:
        """Expected (w, h) of the referenced object (from the scene's matching objects)."""
        found = [o for o in self.task.objects if _matches(ref, o)]
        if not found:
            return SIZE_EXTENT["medium"], SIZE_EXTENT["medium"]
        b = found[0].box
        return b.w, b.h

    def others(self, *refs: Mapping[str, str]) -> list[dict[str, str]]:
        """Descriptors of the scene objects the references do not name (for nearest / extremal)."""
        return [{"colour": o.colour, "shape": o.shape} for o in self.task.objects
                if not any(_matches(r, o) for r in refs)]

    # ------------------------------------------------------------ smooth tests
    def gt(self, value: torch.Tensor, threshold: float, width: float) -> torch.Tensor:
        """Smooth ``value > threshold``: ``½ + atan(x)/π`` (a Cauchy CDF, whose tails never underflow, so a
        sample far from passing still has a gradient, unlike a sigmoid's)."""
        return 0.5 + torch.atan((value - threshold) / width) / math.pi

    def exists(self, ref: Mapping[str, str]) -> torch.Tensor:
        present = self.gt(self.count(ref), 0.5, 0.15)
        if not self.count_gradients:
            present = present.detach()
        if not (self.shapes and "shape" in ref):
            return present
        found = self.matching(ref)
        if not found:  # an absent descriptor: the count alone says whether its colour shows
            return present
        reads = torch.stack([self.shape_read(i, ref["shape"]) for i in found]).max()
        return present * reads

    def coverage(self, i: int) -> torch.Tensor:
        """``(H, W)`` coverage α of scene object ``i`` as the verifier reads it: each pixel unmixed as
        ``α·colour + (1−α)·background`` (luma-weighted, ``segment._cover``), with pixels of the scene's other
        colours left out and a colour shared with other scene objects split by the EM masks. Linear in
        the pixels, so (unlike a colour membership, which a small shade change can halve) it cannot be
        lowered without the verifier seeing the change."""
        o = self.task.objects[i]
        weights = _LUMA.to(self.image)
        under = _RGB[_INDEX[self.task.background]].to(self.image)
        v = (_RGB[_INDEX[o.colour]].to(self.image) - under) @ weights.T
        alpha = (torch.einsum("chw,dc->hwd", self.image - under[:, None, None], weights) @ v / (v @ v)).clamp(0, 1)
        others = sorted({p.colour for p in self.task.objects} - {o.colour, self.task.background})
        if others:
            alpha = alpha * (1 - self.p[[_INDEX[c] for c in others]].sum(0)).clamp(0, 1)
        if sum(p.colour == o.colour for p in self.task.objects) > 1:
            alpha = alpha * (self.obj_masks[i] / self.p[_INDEX[o.colour]].clamp(min=1e-6)).clamp(0, 1)
        return alpha

    def shape_read(self, i: int, shape: str) -> torch.Tensor:
        """Smooth "the verifier reads scene object ``i`` as ``shape``" in (0, 1): ``gt`` of the margin of the
        named template's score over the best other shape's (soft IoU less the aspect penalty) on the
        object's :meth:`coverage`. Templates are placed from its detached moments; a coverage of under
        one pixel reads as nothing (½, no gradient)."""
        m = self.coverage(i)
        a = m.detach().double().cpu().numpy()
        if a.sum() < 1.0:
            return (m.sum() * 0.0).detach() + 0.5
        # the verifier's aspect is its sub-pixel box's; the extents of the (squashed) row and column
        # profiles are that box's width and height, and keep a gradient (a hexagon's box is 0.87 wide)
        squash = ((m - PROFILE_FLOOR) / (1 - PROFILE_FLOOR)).clamp(0, 1)
        aspect = squash.amax(0).sum() / squash.amax(1).sum().clamp(min=1.0)
        placements = placements_by_moments(a)
        penalty = []
        for s in SHAPES:
            miss = (aspect.clamp(min=1e-3) / ASPECT[s]).log().abs()
            if s in FREE_ASPECT:
                miss = torch.minimum(miss, (aspect.clamp(min=1e-3) * ASPECT[s]).log().abs())
            penalty.append(ASPECT_WEIGHT * miss)
        t = torch.from_numpy(coverages(placements, tuple(a.shape))).to(m)
        iou = torch.minimum(m[None], t).flatten(1).sum(1) / torch.maximum(m[None], t).flatten(1).sum(1).clamp(min=1e-6)
        score = iou - torch.stack(penalty)
        k = SHAPES.index(shape)
        rival = torch.cat([score[:k], score[k + 1:]]).max()
        return self.gt(score[k] - rival, 0.0, SHAPE_WIDTH)

    def left(self, a: Mapping[str, str], b: Mapping[str, str], axis: int) -> torch.Tensor:
        """Smooth verifier left-of (axis 0) / above (axis 1): ``c_a < c_b − 0.1·(w_a + w_b)``."""
        margin = 0.1 * (self.box(a)[axis] + self.box(b)[axis])
        return self.gt(self.centroid(b)[axis] - self.centroid(a)[axis], margin, self.t)

    def distance(self, a: Mapping[str, str], b: Mapping[str, str]) -> torch.Tensor:
        return ((self.centroid(a) - self.centroid(b)) ** 2).sum().add(1e-8).sqrt()

    def radius(self, ref: Mapping[str, str]) -> float:
        w, h = self.box(ref)
        return 0.25 * (w + h)

    # ------------------------------------------------------------ constraints
    def score(self, c: Constraint) -> torch.Tensor:
        """``s ∈ (0, 1)`` for one constraint (a smooth version of ``verify.check``). Without count
        gradients, counts and the presence factor of relations keep their value but pass no gradient."""
        s = self._score(c)
        # exists (and so absent, and relations' presence) cuts its own mass gradient, keeping the shape term's
        return s if self.count_gradients or c.type not in COUNT_TYPES - {"exists", "absent"} else s.detach()

    def _score(self, c: Constraint) -> torch.Tensor:
        t, a = c.type, c.args
        if t == "exists":
            return self.exists(a["ref"])
        if t == "absent":
            return 1 - self.exists(a["ref"])
        if t in ("count_shape", "count_colour", "count_colour_shape"):
            n = self.count({k: a[k] for k in ("colour", "shape") if k in a})
            return _bump((n - a["n"]) / 0.5)
        if t == "total_count":
            fg = 1 - self.p[_INDEX[self.task.background]]
            return _bump((fg.mean() / self.unit_all - a["n"]) / 0.5)
        if t == "at_least":
            return self.gt(self.count(a["ref"]), a["n"] - 0.5, 0.15)
        if t == "at_most":
            return 1 - self.gt(self.count(a["ref"]), a["n"] + 0.5, 0.15)
        if t == "more_than":
            return self.gt(self.count(a["a"]) - self.count(a["b"]), 0.5, 0.15)
        if t == "equal_count":
            return _bump((self.count(a["a"]) - self.count(a["b"])) / 0.5)
        if t == "background_colour":
            p = self.p[_INDEX[a["colour"]]]
            border = torch.cat([p[[0, -1]].flatten(), p[:, [0, -1]].flatten()])
            return self.gt(border.mean(), 0.5, 0.1)
        refs = [a[k] for k in ("ref", "a", "b", "c") if k in a]
        present = torch.stack([self.exists(r) for r in refs]).prod()
        return present * self.relation(c, refs)

    def relation(self, c: Constraint, refs: list[Mapping[str, str]]) -> torch.Tensor:
        """The smooth predicate of a constraint on referenced objects (their presence is scored apart)."""
        t, a = c.type, c.args
        x = refs[0]
        one = torch.ones((), dtype=self.p.dtype, device=self.p.device)
        if t == "colour_of":
            return self.gt(self.mass({"colour": a["colour"]}) / self.unit(x), 0.5, 0.15)
        if t in ("shape_of", "same_colour", "different_colour", "same_shape"):
            return one  # not measured beyond presence [derived]: colour is what the masks select on
        if t == "size_class":
            # between the class boundaries' areas (the verifier's extent boundaries, squared)
            log_mass = self.mass(x).clamp(min=1e-6).log()
            lo = -math.inf if a["size"] == "small" else _log_area(self, x, SMALL_MEDIUM)
            hi = math.inf if a["size"] == "large" else _log_area(self, x, MEDIUM_LARGE)
            s = one
            if lo > -math.inf:
                s = s * self.gt(log_mass, lo, 0.15)
            if hi < math.inf:
                s = s * (1 - self.gt(log_mass, hi, 0.15))
            return s
        if t == "filled":
            o = next((o for o in self.task.objects if _matches(x, o)), None)
            if o is None:
                return one
            full = object_area(Obj(o.id, o.shape, o.colour, o.size, True, o.x, o.y))
            ring = object_area(Obj(o.id, o.shape, o.colour, o.size, False, o.x, o.y))
            mid = 0.5 * (full + ring)
            s = self.gt(self.mass(x), mid, 0.15 * mid)
            return s if a["filled"] else 1 - s
        if t == "extremal":
            axis = 0 if a["direction"] in ("leftmost", "rightmost") else 1
            first = a["direction"] in ("leftmost", "topmost")
            tests = [self.left(x, o, axis) if first else self.left(o, x, axis) for o in self.others(x)]
            return torch.stack(tests).prod() if tests else one
        if t == "region":
            vertical, horizontal = a["region"].split("-")
            cx, cy = self.centroid(x)
            sx = self.gt(0.5 - cx if horizontal == "left" else cx - 0.5, 0.0, self.t)
            sy = self.gt(0.5 - cy if vertical == "top" else cy - 0.5, 0.0, self.t)
            return sx * sy
        y = refs[1]
        if t == "bigger":
            return self.gt(self.mass(x).clamp(min=1e-6).log() - self.mass(y).clamp(min=1e-6).log(), 2 * math.log(1.15), 0.15)
        if t in ("left_of", "right_of", "above", "below"):
            first, second = (x, y) if t in ("left_of", "above") else (y, x)
            return self.left(first, second, 0 if t in ("left_of", "right_of") else 1)
        if t in ("horizontally_aligned", "vertically_aligned"):
            axis = 1 if t == "horizontally_aligned" else 0
            gap = (self.centroid(x)[axis] - self.centroid(y)[axis]).abs()
            return 1 - self.gt(gap, 0.05, 0.5 * self.t)
        if t == "nearest_to":
            d = self.distance(x, y)
            tests = [self.gt(self.distance(x, o) - d, 0.0, self.t) for o in self.others(x, y)]
            return torch.stack(tests).prod() if tests else one
        if t == "between":
            z = refs[2]
            b, cc, p = self.centroid(y), self.centroid(z), self.centroid(x)
            seg = cc - b
            length2 = (seg**2).sum() + 1e-6
            rel = p - b
            frac = (rel * seg).sum() / length2
            off = (rel[0] * seg[1] - rel[1] * seg[0]).abs() / length2.sqrt()
            on_segment = self.gt(frac, 0.15, 0.05) * (1 - self.gt(frac, 0.85, 0.05))
            return on_segment * (1 - self.gt(off, 0.25 * length2.sqrt(), self.t))
        d = self.distance(x, y)
        rx, ry = self.radius(x), self.radius(y)
        if t == "inside":
            return 1 - self.gt(d, max(ry - rx, 0.02), self.t)
        if t == "touching":
            return _bump((d - (rx + ry)) / (2 * self.t))
        if t == "overlapping":
            return (1 - self.gt(d, 0.8 * (rx + ry), self.t)) * self.gt(d, abs(ry - rx), self.t)
        raise ValueError(f"unknown constraint type {t!r}")


#: constraints scored from soft masses: their gradient grows or shrinks objects rather than adding or
#: removing one (what the verifier's component count would need)
COUNT_TYPES = frozenset({"exists", "absent", "count_shape", "count_colour", "count_colour_shape", "total_count",
                         "at_least", "at_most", "more_than", "equal_count"})


def _bump(x: torch.Tensor) -> torch.Tensor:
    """Smooth ``x ≈ 0`` in (0, 1]: ``1/(1 + x²)`` (heavy-tailed for the same reason as ``gt``)."""
    return 1 / (1 + x**2)


def _log_area(scene: SoftScene, ref: Mapping[str, str], extent: float) -> float:
    """log of the area a ``ref`` object covers at ``extent`` (its shape's fill of its box)."""
    found = [o for o in scene.task.objects if _matches(ref, o)]
    shape = found[0].shape if found else "circle"
    w, h = box_size(shape, extent)
    return math.log(MOMENTS[shape][0] * w * h)
