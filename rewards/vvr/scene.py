"""Building a VVR scene: objects placed with clear gaps, and the structured pairs constraints need.

Shared with the motion generator (``rewards.vvr_motion.generate``): the layout margins ``GAP`` and
``EDGE``, :func:`box_gap` and :class:`Retry`. See ``rewards.vvr.generate`` for the restrictions that keep
every scene verifiable at 64 px.
"""

from __future__ import annotations

import functools
import math
import random
from dataclasses import replace
from typing import Callable

import numpy as np
from PIL import Image, ImageDraw
from scipy import ndimage

from rewards.vvr import predicates as P
from rewards.vvr.geometry import NOT_SMALL, draw_shape
from rewards.vvr.palette import COLOURS, PALETTE, PALETTE_LAB, delta_e00
from rewards.vvr.tasks import Constraint, Obj, Task
from rewards.vvr.vocabulary import Vocabulary

GAP = 0.07  # box gap between unrelated objects (image fractions): they never touch, even blurred
EDGE = 0.03  # objects stay this far from the image border
K_GEN = 0.3  # left-of margin factor (the verifier's is 0.1)
ALIGN_GEN = 0.01  # aligned centres differ by less than this (the verifier allows 0.05)
BIGGER_GEN = 1.3  # extent ratio for "bigger" (the verifier's is 1.15)
BETWEEN_MARGIN_GEN, BETWEEN_BAND_GEN = 0.3, 0.1  # "between": well inside the segment, near the line
NEAREST_GEN = 0.7  # the nearest object is this much closer than any other
REGION_GEN = 0.1  # distance of a centre from the midlines for "region"
CONTRAST = 25.0  # ΔE00 an object colour keeps from the background
INSIDE_LUMA = 40.0  # luma difference (0-255) between an inner object and its container
PENETRATION = 0.006  # touching objects overlap by this much (≈ 0.4 px at 64 px) so they visibly meet
_RES = 400  # raster used to lay out structured pairs (px per image width)
CONTAINERS = ("circle", "square", "hexagon", "pentagon")
MIX_DISTANCE = 30.0  # RGB distance under which a colour passes for a mix of two others


def near_mixes() -> dict[frozenset[str], frozenset[str]]:
    """Colour pair → the palette colours that an anti-aliased edge between the two passes close to."""
    rgb = {c: np.array(v, dtype=float) for c, v in PALETTE.items()}
    table: dict[frozenset[str], frozenset[str]] = {}
    for a in COLOURS:
        for b in COLOURS:
            e = rgb[b] - rgb[a]
            if a >= b:
                continue
            near = set()
            for c in COLOURS:
                t = float(np.clip((rgb[c] - rgb[a]) @ e / (e @ e), 0, 1))
                if c not in (a, b) and 0.15 <= t <= 0.85 and np.linalg.norm(rgb[c] - rgb[a] - t * e) < MIX_DISTANCE:
                    near.add(c)
            table[frozenset((a, b))] = frozenset(near)
    return table


#: e.g. grey for black/white, brown for black/orange, orange for red/yellow
NEAR_MIX = near_mixes()


def ref_of(o: Obj, *keys: str) -> dict[str, str]:
    """The descriptor of ``o`` by ``keys`` (default colour and shape): ``{"colour": "red", "shape": "star"}``."""
    keys = keys or ("colour", "shape")
    return {k: getattr(o, k) for k in keys}


def matches(ref: dict[str, str], o: Obj) -> bool:
    """Whether ``o`` fits the descriptor ``ref``."""
    return all(getattr(o, k) == v for k, v in ref.items())


def box_gap(a: P.Box, b: P.Box) -> float:
    """The gap between two boxes along the axis where they are furthest apart (< 0: they overlap)."""
    return max(abs(a.cx - b.cx) - (a.w + b.w) / 2, abs(a.cy - b.cy) - (a.h + b.h) / 2)


def raster(o: Obj) -> np.ndarray:
    """The object's mask on the layout raster, ``(_RES, _RES)`` bool."""
    img = Image.new("L", (_RES, _RES), 0)
    b = o.box
    box = ((b.cx - b.w / 2) * _RES, (b.cy - b.h / 2) * _RES, (b.cx + b.w / 2) * _RES, (b.cy + b.h / 2) * _RES)
    draw_shape(ImageDraw.Draw(img), o.shape, box, 255)
    return np.asarray(img) > 127


def luma(colour: str) -> float:
    """Rec. 601 luma (0-255) of a palette colour."""
    r, g, b = PALETTE[colour]
    return 0.299 * r + 0.587 * g + 0.114 * b


def sized(o: Obj, size: str) -> Obj:
    """``o`` at ``size``, except that hexagons and pentagons are never small (see ``NOT_SMALL``)."""
    return replace(o, size="medium" if size == "small" and o.shape in NOT_SMALL else size)


def can_outline(shape: str, size: str) -> bool:
    """Whether an outlined object keeps a clear hole at 64 px (the verifier tells outline by the hole)."""
    if size == "large":
        return shape != "star"
    return size == "medium" and shape in CONTAINERS


@functools.cache  # a scene asks for a dozen pairs and a task list draws thousands of scenes
def colour_contrast(colour: str, background: str) -> float:
    """CIEDE2000 difference between two palette colours."""
    return float(delta_e00(PALETTE_LAB[COLOURS.index(colour)], PALETTE_LAB[COLOURS.index(background)]))


class Scene:
    """A scene under construction: objects in paint order plus the structured pairs laid out."""

    def __init__(self, rng: random.Random, vocab: Vocabulary, background: str):
        self.rng, self.vocab, self.background = rng, vocab, background
        self.colours = [c for c in vocab.colours if colour_contrast(c, background) >= CONTRAST]
        self.objs: list[Obj] = []
        self.inside: list[tuple[int, int]] = []  # (inner, container)
        self.touching: list[tuple[int, int]] = []
        self.overlap: list[tuple[int, int]] = []  # (top, bottom)
        self.touch_pairs: set[frozenset[str]] = set()  # colours of objects in contact

    # --- descriptors -------------------------------------------------------------------------------
    def size(self) -> str:
        return self.rng.choice(self.vocab.sizes)

    def new(self, colour: str | None = None, shape: str | None = None, size: str | None = None,
            avoid: tuple[str, ...] = ()) -> Obj:
        """An object (at the origin) whose colour+shape is new to the scene unless both are given.

        ``avoid``: colours it must not take (those of a partner not yet placed, which count as present
        and as touching it). No colour may be what an edge between two touching colours passes for.
        """
        used = {(o.colour, o.shape) for o in self.objs}
        colours = [x for x in self.colours if x not in avoid and self._clean_edges(x, avoid)]
        for _ in range(100):
            if not colours and colour is None:
                raise Retry
            c = colour or self.rng.choice(colours)
            s = shape or self.rng.choice(self.vocab.shapes)
            if (c, s) not in used or (colour and shape):
                return sized(Obj(0, s, c, "medium", True, 0.0, 0.0), size or self.size())
        raise Retry

    def _clean_edges(self, colour: str, partners: tuple[str, ...]) -> bool:
        """Whether adding ``colour`` (touching ``partners``) keeps every edge from passing for a colour in
        the scene: a blurred black-on-white edge is grey, black-on-orange brown, red-on-yellow orange."""
        present = {o.colour for o in self.objs} | set(partners) | {colour, self.background}
        edges = {frozenset((self.background, c)) for c in present - {self.background}} | self.touch_pairs
        edges |= {frozenset((colour, p)) for p in partners}
        return not any(NEAR_MIX[e] & present for e in edges if len(e) == 2)

    # --- placement ---------------------------------------------------------------------------------
    def place(self, group: list[Obj], fix_x: float | None = None, fix_y: float | None = None,
              accept: Callable[[list[Obj]], bool] | None = None) -> list[int]:
        """Translate ``group`` (laid out around the origin) to a free spot; indices of its objects."""
        boxes = [o.box for o in group]
        lo_x, hi_x = min(b.cx - b.w / 2 for b in boxes), max(b.cx + b.w / 2 for b in boxes)
        lo_y, hi_y = min(b.cy - b.h / 2 for b in boxes), max(b.cy + b.h / 2 for b in boxes)
        for _ in range(60):
            tx = fix_x if fix_x is not None else self.rng.uniform(EDGE - lo_x, 1 - EDGE - hi_x)
            ty = fix_y if fix_y is not None else self.rng.uniform(EDGE - lo_y, 1 - EDGE - hi_y)
            moved = [replace(o, x=o.x + tx, y=o.y + ty) for o in group]
            if not all(EDGE - 1e-9 <= b.cx - b.w / 2 and b.cx + b.w / 2 <= 1 - EDGE + 1e-9
                       and EDGE - 1e-9 <= b.cy - b.h / 2 and b.cy + b.h / 2 <= 1 - EDGE + 1e-9
                       for b in (m.box for m in moved)):
                continue
            if all(box_gap(m.box, e.box) >= GAP for m in moved for e in self.objs) and (accept is None or accept(moved)):
                start = len(self.objs)
                self.objs.extend(moved)
                return list(range(start, len(self.objs)))
        raise Retry

    # --- structured pairs --------------------------------------------------------------------------
    def add_inside(self) -> None:
        container = self.new(shape=self.rng.choice([s for s in CONTAINERS if s in self.vocab.shapes]), size="large")
        inner = self.new(size="small", avoid=(container.colour,))
        # the inner object must differ from its container in luma: JPEG halves chroma, so a red star
        # on a brown disc (equal luma) blurs into a blob at 64 px
        if inner.size != "small" or abs(luma(inner.colour) - luma(container.colour)) < INSIDE_LUMA:
            raise Retry
        c, i = replace(container, x=0.5, y=0.5), replace(inner, x=0.5, y=0.5)
        # the inner object must keep ≥ 0.03 of the container around it
        if (ndimage.distance_transform_edt(raster(c))[raster(i)] < 0.03 * _RES).any():
            raise Retry
        a, b = self.place([container, inner])
        self.inside.append((b, a))
        self.touch_pairs.add(frozenset((container.colour, inner.colour)))

    def add_touching(self) -> None:
        a = self.new()
        b = self.new(avoid=(a.colour,))
        a0 = replace(a, x=0.5, y=0.5)
        horizontal = self.rng.random() < 0.5
        # a small sideways offset, so not every touching pair is centre-aligned
        side = self.rng.uniform(-0.2, 0.2) * min(a.box.extent, b.box.extent)
        mask_a = raster(a0)

        sign = self.rng.choice([-1, 1])

        def at(t: float) -> Obj:  # b at signed distance t from a along the touching axis
            return replace(b, x=0.5 + (t if horizontal else side), y=0.5 + (side if horizontal else t))

        lo, hi = 0.0, a.box.extent + b.box.extent  # overlapping at lo, apart at hi
        for _ in range(16):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if (mask_a & raster(at(sign * mid))).any() else (lo, mid)
        b1 = at(sign * (hi - PENETRATION))
        i, j = self.place([replace(a, x=0.0, y=0.0), replace(b1, x=b1.x - 0.5, y=b1.y - 0.5)])
        self.touching.append((i, j))
        self.touch_pairs.add(frozenset((a.colour, b.colour)))

    def add_overlap(self) -> None:
        # the hidden object keeps its box visible; thin star and triangle tips vanish at 64 px, so an
        # overlapped star could not be measured
        bottom = self.new(shape=self.rng.choice([s for s in self.vocab.shapes if s not in ("star", "triangle")]),
                          size=self.rng.choice(["medium", "large"]))
        top = self.new(size="small" if bottom.size == "medium" else self.rng.choice(["small", "medium"]),
                       avoid=(bottom.colour,))
        b0 = replace(bottom, x=0.5, y=0.5)
        mask_b = raster(b0)
        ys, xs = np.nonzero(mask_b)
        full_box = (xs.min(), xs.max(), ys.min(), ys.max())
        angles = [45, 135, 225, 315, 20, 70, 110, 160, 200, 250, 290, 340]
        self.rng.shuffle(angles)
        for deg in angles:
            u = np.array([np.cos(np.radians(deg)), np.sin(np.radians(deg))])
            # walk out from the centre to the boundary of the bottom object
            steps = np.arange(0, 0.4 * _RES)
            pts = (0.5 * _RES + np.outer(steps, u)).astype(int)
            ok = (pts >= 0).all(1) & (pts < _RES).all(1)
            inside = mask_b[pts[ok, 1], pts[ok, 0]]
            r = steps[ok][~inside][0] / _RES if (~inside).any() else 0.4
            t0 = replace(top, x=0.5 + r * u[0], y=0.5 + r * u[1])
            mask_t = raster(t0)
            visible = mask_b & ~mask_t
            vy, vx = np.nonzero(visible)
            if (
                max(abs(vx.min() - full_box[0]), abs(vx.max() - full_box[1]),
                    abs(vy.min() - full_box[2]), abs(vy.max() - full_box[3])) <= 1
                and visible.sum() >= 0.6 * mask_b.sum()
                and (mask_t & mask_b).sum() >= 0.35 * mask_t.sum()
            ):
                i, j = self.place([replace(bottom, x=0.0, y=0.0), replace(t0, x=t0.x - 0.5, y=t0.y - 0.5)])
                self.overlap.append((j, i))
                self.touch_pairs.add(frozenset((bottom.colour, top.colour)))
                return
        raise Retry

    def add_aligned(self, horizontal: bool) -> None:
        (i,) = self.place([self.new()])
        o = self.objs[i]
        self.place([self.new()], fix_y=o.y if horizontal else None, fix_x=None if horizontal else o.x)

    def add_between(self) -> None:
        def small() -> Obj:
            return self.new(size=self.rng.choice(["small", "medium"]))

        (b,) = self.place([small()])
        ob = self.objs[b]
        (c,) = self.place([small()], accept=lambda m: math.dist((m[0].x, m[0].y), (ob.x, ob.y)) >= 0.55)
        oc = self.objs[c]
        t, off = self.rng.uniform(0.4, 0.6), self.rng.uniform(-0.05, 0.05)
        dx, dy = oc.x - ob.x, oc.y - ob.y
        self.place([small()], fix_x=ob.x + t * dx - off * dy, fix_y=ob.y + t * dy + off * dx)

    def fill(self, n: int, outline: bool = False) -> None:
        """Add unique-descriptor objects up to ``n``; with ``outline`` the first one is outlined."""
        while len(self.objs) < n:
            if outline:
                shape = self.rng.choice([s for s in self.vocab.shapes if can_outline(s, "large")])
                size = self.rng.choice(["medium", "large"]) if can_outline(shape, "medium") else "large"
                o = replace(self.new(shape=shape, size=size), filled=False)
                outline = False
            else:
                o = self.new()
            self.place([o])

    def finish(self, level: str, task_id: str, constraints: list[Constraint]) -> Task:
        objs = tuple(replace(o, id=k, x=round(float(o.x), 4), y=round(float(o.y), 4)) for k, o in enumerate(self.objs))
        return Task(task_id, level, self.background, objs, tuple(constraints))


class Retry(Exception):
    """The scene being built cannot satisfy its plan; start it again."""
