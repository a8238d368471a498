"""Seeded generation of VVR tasks: sample a scene, then pick constraints that are true in it.

Task ``i`` of ``generate_tasks(n, seed=s, level=l)`` is drawn from its own ``random.Random("vvr:l:s:i")``
(string seeds are hashed with SHA-512, not ``hash()``), so tasks are identical across runs and processes
and a longer list starts with the shorter one.

Levels [derived]:

* easy: one filled medium object of the core vocabulary at a random position on white; the single
  constraint is ``exists``: "a red circle".
* medium: two objects joined by one relation (all their attributes named), or a count ≤ 3.
* hard: 3-4 objects, ≥ 3 constraints of any of the 32 types, at least one a spatial relation; the
  first constraint's type is drawn uniformly and the scene is built so that it can hold (an inside pair, a touching pair, an aligned
  pair, duplicates to count, an outlined object, a dark background...). Every object is named by some
  clause: an object no constraint names gets an ``exists`` clause.

Constraints are chosen with stricter margins than the verifier's thresholds (``predicates``), unrelated
objects keep a clear gap, and structured pairs are laid out on a fine raster so that touching objects
really touch, an overlapped object keeps its full bounding box visible, and an inner object sits well
inside its container.

Restrictions that keep every task verifiable at 64 px after JPEG and blur [derived]: sizes are
0.20/0.27/0.36 of the image (12.8/17.3/23 px at 64 px); hexagons and pentagons are never small (at
13 px they cannot be told from a circle); no scene holds a colour that an edge between two touching
colours passes for (grey between black and white, brown between black and orange, orange between red
and yellow, ...; an object always touches the background); outlined objects are large, or medium
circles/squares/hexagons/pentagons, never stars; an overlapped object is never a star or triangle
(their thin tips vanish); an inner object is small and differs from its container in luma.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace
from typing import Callable

import numpy as np
from PIL import Image, ImageDraw
from scipy import ndimage

from rewards.vvr import predicates as P
from rewards.vvr.geometry import NOT_SMALL, SHAPES, SIZES, draw_shape
from rewards.vvr.palette import COLOURS, PALETTE, PALETTE_LAB, delta_e00
from rewards.vvr.tasks import (
    CONSTRAINT_TYPES,
    DIRECTIONS,
    LEVELS,
    REGIONS,
    Constraint,
    Obj,
    Task,
)


@dataclass(frozen=True)
class Vocabulary:
    """What a level's scenes may contain."""

    colours: tuple[str, ...]
    shapes: tuple[str, ...]
    sizes: tuple[str, ...]
    outline: bool
    backgrounds: tuple[str, ...]


EASY_COLOURS: tuple[str, ...] = ("red", "green", "blue", "yellow", "purple", "orange")
EASY_SHAPES: tuple[str, ...] = ("circle", "square", "triangle", "star")
MEDIUM_COLOURS: tuple[str, ...] = EASY_COLOURS + ("cyan", "pink", "brown", "black")
MEDIUM_SHAPES: tuple[str, ...] = EASY_SHAPES + ("hexagon", "rectangle")
#: per-level vocabularies (the tiny pretraining model learns the easy one first)
VOCABULARIES: dict[str, Vocabulary] = {
    "easy": Vocabulary(EASY_COLOURS, EASY_SHAPES, ("medium",), False, ("white",)),
    "medium": Vocabulary(MEDIUM_COLOURS, MEDIUM_SHAPES, SIZES, False, ("white",)),
    "hard": Vocabulary(COLOURS, SHAPES, SIZES, True, ("white", "black", "gray")),
}
#: the spatial relation types (the last group of ``CONSTRAINT_TYPES``)
RELATIONS: tuple[str, ...] = CONSTRAINT_TYPES[CONSTRAINT_TYPES.index("left_of"):]
#: the relations a medium task may use between its two objects
MEDIUM_RELATIONS: tuple[str, ...] = (
    "left_of", "right_of", "above", "below", "bigger", "inside", "touching",
    "horizontally_aligned", "vertically_aligned",
)

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
_CONTAINERS = ("circle", "square", "hexagon", "pentagon")
MIX_DISTANCE = 30.0  # RGB distance under which a colour passes for a mix of two others


def _near_mixes() -> dict[frozenset[str], frozenset[str]]:
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
_NEAR_MIX = _near_mixes()


def _ref(o: Obj, *keys: str) -> dict[str, str]:
    keys = keys or ("colour", "shape")
    return {k: getattr(o, k) for k in keys}


def _matches(ref: dict[str, str], o: Obj) -> bool:
    return all(getattr(o, k) == v for k, v in ref.items())


def _gap(a: P.Box, b: P.Box) -> float:
    return max(abs(a.cx - b.cx) - (a.w + b.w) / 2, abs(a.cy - b.cy) - (a.h + b.h) / 2)


def _raster(o: Obj) -> np.ndarray:
    img = Image.new("L", (_RES, _RES), 0)
    b = o.box
    box = ((b.cx - b.w / 2) * _RES, (b.cy - b.h / 2) * _RES, (b.cx + b.w / 2) * _RES, (b.cy + b.h / 2) * _RES)
    draw_shape(ImageDraw.Draw(img), o.shape, box, 255)
    return np.asarray(img) > 127


def _luma(colour: str) -> float:
    r, g, b = PALETTE[colour]
    return 0.299 * r + 0.587 * g + 0.114 * b


def _sized(o: Obj, size: str) -> Obj:
    """``o`` at ``size``, except that hexagons and pentagons are never small (see ``NOT_SMALL``)."""
    return replace(o, size="medium" if size == "small" and o.shape in NOT_SMALL else size)


def can_outline(shape: str, size: str) -> bool:
    """Whether an outlined object keeps a clear hole at 64 px (the verifier tells outline by the hole)."""
    if size == "large":
        return shape != "star"
    return size == "medium" and shape in _CONTAINERS


class _Scene:
    """A scene under construction: objects in paint order plus the structured pairs laid out."""

    def __init__(self, rng: random.Random, vocab: Vocabulary, background: str):
        self.rng, self.vocab, self.background = rng, vocab, background
        bg_lab = PALETTE_LAB[COLOURS.index(background)]
        self.colours = [c for c in vocab.colours if delta_e00(PALETTE_LAB[COLOURS.index(c)], bg_lab) >= CONTRAST]
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
                raise _Retry
            c = colour or self.rng.choice(colours)
            s = shape or self.rng.choice(self.vocab.shapes)
            if (c, s) not in used or (colour and shape):
                return _sized(Obj(0, s, c, "medium", True, 0.0, 0.0), size or self.size())
        raise _Retry

    def _clean_edges(self, colour: str, partners: tuple[str, ...]) -> bool:
        """Whether adding ``colour`` (touching ``partners``) keeps every edge from passing for a colour in
        the scene: a blurred black-on-white edge is grey, black-on-orange brown, red-on-yellow orange."""
        present = {o.colour for o in self.objs} | set(partners) | {colour, self.background}
        edges = {frozenset((self.background, c)) for c in present - {self.background}} | self.touch_pairs
        edges |= {frozenset((colour, p)) for p in partners}
        return not any(_NEAR_MIX[e] & present for e in edges if len(e) == 2)

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
            if all(_gap(m.box, e.box) >= GAP for m in moved for e in self.objs) and (accept is None or accept(moved)):
                start = len(self.objs)
                self.objs.extend(moved)
                return list(range(start, len(self.objs)))
        raise _Retry

    # --- structured pairs --------------------------------------------------------------------------
    def add_inside(self) -> None:
        container = self.new(shape=self.rng.choice([s for s in _CONTAINERS if s in self.vocab.shapes]), size="large")
        inner = self.new(size="small", avoid=(container.colour,))
        # the inner object must differ from its container in luma: JPEG halves chroma, so a red star
        # on a brown disc (equal luma) blurs into a blob at 64 px
        if inner.size != "small" or abs(_luma(inner.colour) - _luma(container.colour)) < INSIDE_LUMA:
            raise _Retry
        c, i = replace(container, x=0.5, y=0.5), replace(inner, x=0.5, y=0.5)
        # the inner object must keep ≥ 0.03 of the container around it
        if (ndimage.distance_transform_edt(_raster(c))[_raster(i)] < 0.03 * _RES).any():
            raise _Retry
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
        mask_a = _raster(a0)

        sign = self.rng.choice([-1, 1])

        def at(t: float) -> Obj:  # b at signed distance t from a along the touching axis
            return replace(b, x=0.5 + (t if horizontal else side), y=0.5 + (side if horizontal else t))

        lo, hi = 0.0, a.box.extent + b.box.extent  # overlapping at lo, apart at hi
        for _ in range(16):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if (mask_a & _raster(at(sign * mid))).any() else (lo, mid)
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
        mask_b = _raster(b0)
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
            mask_t = _raster(t0)
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
        raise _Retry

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


class _Retry(Exception):
    """The scene being built cannot satisfy its plan; start it again."""


# --- candidate constraints true in a scene ---------------------------------------------------------


def candidates(sc: _Scene, ctype: str) -> list[Constraint]:
    """Every constraint of ``ctype`` that holds in ``sc`` with the generator's margins."""
    objs = sc.objs
    boxes = [o.box for o in objs]
    idx = range(len(objs))

    def count(ref: dict[str, str]) -> int:
        return sum(_matches(ref, o) for o in objs)

    uniq = [i for i in idx if count(_ref(objs[i])) == 1]
    uniq_shape = [i for i in idx if count(_ref(objs[i], "shape")) == 1]
    uniq_colour = [i for i in idx if count(_ref(objs[i], "colour")) == 1]
    inside_pairs = {frozenset(p) for p in sc.inside}
    pairs = [(i, j) for i in uniq for j in uniq if i != j]
    free_pairs = [(i, j) for i, j in pairs if frozenset((i, j)) not in inside_pairs]

    def C(**args: object) -> Constraint:
        return Constraint(ctype, args)

    def kind_refs() -> list[dict[str, str]]:
        out: list[dict[str, str]] = []
        for keys in (("shape",), ("colour",), ("colour", "shape")):
            for o in objs:
                r = _ref(o, *keys)
                if r not in out:
                    out.append(r)
        return out

    full = [_ref(objs[i]) for i in idx]
    full_distinct = [r for k, r in enumerate(full) if r not in full[:k]]
    if ctype == "exists":
        return [C(ref=r) for r in full_distinct]
    if ctype == "absent":
        present_c, present_s = {o.colour for o in objs}, {o.shape for o in objs}
        # distractor descriptors: an absent combination of a present colour or a present shape
        return [C(ref={"colour": c, "shape": s}) for c in sc.colours for s in sc.vocab.shapes
                if count({"colour": c, "shape": s}) == 0 and (c in present_c or s in present_s)]
    if ctype == "count_shape":
        return [C(shape=s, n=count({"shape": s})) for s in dict.fromkeys(o.shape for o in objs)]
    if ctype == "count_colour":
        return [C(colour=c, n=count({"colour": c})) for c in dict.fromkeys(o.colour for o in objs)]
    if ctype == "count_colour_shape":
        return [C(colour=r["colour"], shape=r["shape"], n=count(r)) for r in full_distinct]
    if ctype == "total_count":
        return [C(n=len(objs))]
    if ctype == "at_least":
        return [C(ref=r, n=k) for r in kind_refs() for k in range(2, count(r) + 1)]
    if ctype == "at_most":
        return [C(ref=r, n=k) for r in kind_refs() for k in range(max(1, count(r)), 4)]
    if ctype in ("more_than", "equal_count"):
        refs = kind_refs()
        out = []
        for a in refs:
            for b in refs:
                if a != b and set(a) == set(b):
                    if (ctype == "more_than" and count(a) > count(b)) or (
                        ctype == "equal_count" and count(a) == count(b)
                    ):
                        out.append(C(a=a, b=b))
        if ctype == "more_than":  # "more circles than hexagons" with no hexagon at all
            out += [C(a=_ref(o, "shape"), b={"shape": s}) for o in objs[:1] for s in sc.vocab.shapes if count({"shape": s}) == 0]
        return out
    if ctype == "colour_of":
        return [C(ref=_ref(objs[i], "shape"), colour=objs[i].colour) for i in uniq_shape]
    if ctype == "shape_of":
        return [C(ref=_ref(objs[i], "colour"), shape=objs[i].shape) for i in uniq_colour]
    if ctype == "size_class":
        return [C(ref=_ref(objs[i]), size=objs[i].size) for i in uniq]
    if ctype == "bigger":
        return [C(a=_ref(objs[i]), b=_ref(objs[j])) for i, j in pairs if P.bigger(boxes[i], boxes[j], BIGGER_GEN)]
    if ctype in ("same_colour", "different_colour"):
        same = ctype == "same_colour"
        return [C(a=_ref(objs[i], "shape"), b=_ref(objs[j], "shape")) for i in uniq_shape for j in uniq_shape
                if i < j and (objs[i].colour == objs[j].colour) == same]
    if ctype == "same_shape":
        return [C(a=_ref(objs[i], "colour"), b=_ref(objs[j], "colour")) for i in uniq_colour for j in uniq_colour
                if i < j and objs[i].shape == objs[j].shape]
    if ctype == "background_colour":
        return [C(colour=sc.background)]
    if ctype == "filled":
        return [C(ref=_ref(objs[i]), filled=objs[i].filled) for i in uniq]
    rel: dict[str, Callable[[int, int], bool]] = {
        "left_of": lambda i, j: P.left_of(boxes[i], boxes[j], K_GEN),
        "right_of": lambda i, j: P.left_of(boxes[j], boxes[i], K_GEN),
        "above": lambda i, j: P.above(boxes[i], boxes[j], K_GEN),
        "below": lambda i, j: P.above(boxes[j], boxes[i], K_GEN),
        "horizontally_aligned": lambda i, j: i < j and P.horizontally_aligned(boxes[i], boxes[j], ALIGN_GEN),
        "vertically_aligned": lambda i, j: i < j and P.vertically_aligned(boxes[i], boxes[j], ALIGN_GEN),
        "nearest_to": lambda i, j: len(objs) >= 3 and P.nearest_to(
            boxes[i], boxes[j], [boxes[k] for k in idx if k not in (i, j)], NEAREST_GEN),
    }
    if ctype in rel:
        return [C(a=_ref(objs[i]), b=_ref(objs[j])) for i, j in free_pairs if rel[ctype](i, j)]
    if ctype == "inside":
        return [C(a=_ref(objs[i]), b=_ref(objs[j])) for i, j in sc.inside if i in uniq and j in uniq]
    if ctype in ("touching", "overlapping"):
        return [C(a=_ref(objs[i]), b=_ref(objs[j])) for i, j in (sc.touching if ctype == "touching" else sc.overlap)
                if i in uniq and j in uniq]
    if ctype == "between":
        return [C(a=_ref(objs[i]), b=_ref(objs[j]), c=_ref(objs[k])) for i in uniq for j in uniq for k in uniq
                if len({i, j, k}) == 3 and j < k and not {frozenset((i, j)), frozenset((i, k))} & inside_pairs
                and P.between(boxes[i], boxes[j], boxes[k], BETWEEN_MARGIN_GEN, BETWEEN_BAND_GEN)]
    if ctype == "extremal":
        return [C(ref=_ref(objs[i]), direction=d) for i in uniq for d in DIRECTIONS
                if len(objs) >= 2 and P.extremal(boxes[i], [boxes[k] for k in idx if k != i], d, K_GEN)]
    if ctype == "region":
        return [C(ref=_ref(objs[i]), region=r) for i in uniq for r in REGIONS if P.in_region(boxes[i], r, REGION_GEN)]
    raise ValueError(f"unknown constraint type {ctype!r}")


# --- levels -----------------------------------------------------------------------------------------


def _easy(rng: random.Random, task_id: str) -> Task:
    sc = _Scene(rng, VOCABULARIES["easy"], "white")
    (i,) = sc.place([sc.new()])
    return sc.finish("easy", task_id, [Constraint("exists", {"ref": _ref(sc.objs[i])})])


def _medium(rng: random.Random, task_id: str) -> Task:
    sc = _Scene(rng, VOCABULARIES["medium"], "white")
    if rng.random() < 0.6:
        relation = rng.choice(MEDIUM_RELATIONS)
        if relation == "inside":
            sc.add_inside()
        elif relation == "touching":
            sc.add_touching()
        elif relation in ("horizontally_aligned", "vertically_aligned"):
            sc.add_aligned(relation.startswith("h"))
        else:
            sc.place([sc.new()])
            sc.place([sc.new()])
        found = candidates(sc, relation)
        if not found:
            raise _Retry
        return sc.finish("medium", task_id, [rng.choice(found)])
    n = rng.choice([1, 2, 2, 3, 3])
    kind = rng.choice(["count_colour_shape", "count_colour_shape", "count_shape", "count_colour", "total_count"])
    first = sc.new()
    for _ in range(n):
        if kind == "count_colour_shape":
            o = sc.new(first.colour, first.shape)
        elif kind == "count_shape":
            o = sc.new(shape=first.shape, avoid=tuple(x.colour for x in sc.objs))
        elif kind == "count_colour":
            o = sc.new(colour=first.colour)
        else:
            o = sc.new()
        sc.place([_sized(o, rng.choice(["small", "medium"]))])
    o = sc.objs[0]
    args = {"count_colour_shape": {"colour": o.colour, "shape": o.shape}, "count_shape": {"shape": o.shape},
            "count_colour": {"colour": o.colour}, "total_count": {}}[kind]
    return sc.finish("medium", task_id, [Constraint(kind, {**args, "n": n})])


def _hard(rng: random.Random, task_id: str, primary: str) -> Task:
    vocab = VOCABULARIES["hard"]
    dark = primary == "background_colour" and rng.random() < 0.7 or rng.random() < 0.2
    sc = _Scene(rng, vocab, rng.choice(vocab.backgrounds[1:]) if dark else "white")
    n = rng.choice([3, 4])
    structure = {
        "inside": sc.add_inside, "touching": sc.add_touching, "overlapping": sc.add_overlap,
        "horizontally_aligned": lambda: sc.add_aligned(True), "vertically_aligned": lambda: sc.add_aligned(False),
        "between": sc.add_between,
    }.get(primary)
    if structure is not None:
        structure()
    elif primary in ("count_shape", "count_colour", "count_colour_shape", "at_least", "more_than",
                     "equal_count", "same_colour", "same_shape") or rng.random() < 0.3:
        # duplicates: a repeated colour, shape or both, so counts and comparisons are not all 1
        first = sc.new(size=rng.choice(["small", "medium"]))
        repeat = {"count_shape": "shape", "same_shape": "shape", "count_colour": "colour", "same_colour": "colour"}.get(
            primary, rng.choice(["shape", "colour", "both"]))
        for _ in range(rng.choice([2, 2, 3])):
            o = (sc.new(colour=first.colour, shape=first.shape) if repeat == "both"
                 else sc.new(shape=first.shape, avoid=tuple(x.colour for x in sc.objs if x.shape == first.shape))
                 if repeat == "shape" else sc.new(colour=first.colour))
            sc.place([_sized(o, rng.choice(["small", "medium"]))])
    if rng.random() < 0.1 and structure is None and len(sc.objs) <= 2:
        sc.add_touching() if rng.random() < 0.5 else sc.add_inside()
    sc.fill(max(n, len(sc.objs)), outline=primary == "filled" or rng.random() < 0.15)

    found = candidates(sc, primary)
    if not found:
        raise _Retry
    chosen = [rng.choice(found)]
    others = [t for t in CONSTRAINT_TYPES if t not in (primary, "background_colour")]
    rng.shuffle(others)
    target = rng.choice([3, 3, 4])
    for t in others:
        if len(chosen) >= target:
            break
        options = candidates(sc, t)
        if options:
            chosen.append(rng.choice(options))
    # hard tasks always include a spatial relation
    if not any(c.type in RELATIONS for c in chosen):
        relations = [t for t in RELATIONS if t != primary]
        rng.shuffle(relations)
        options = next((o for o in (candidates(sc, t) for t in relations) if o), None)
        if options is None:
            raise _Retry
        chosen.append(rng.choice(options))
    if len(chosen) < 3:
        raise _Retry
    # outlined objects are always said to be outlined; every object is named by some clause
    for o in sc.objs:
        if not o.filled and not any(c.type == "filled" and _matches(c.args["ref"], o) for c in chosen):
            chosen.append(Constraint("filled", {"ref": _ref(o), "filled": False}))
    named = [r for c in chosen for k, r in c.args.items() if k in ("ref", "a", "b", "c") and len(r) == 2]
    named += [{"colour": c.args["colour"], "shape": c.args["shape"]} for c in chosen if c.type == "count_colour_shape"]
    for o in sc.objs:
        if not any(_matches(r, o) for r in named):
            named.append(_ref(o))
            chosen.append(Constraint("exists", {"ref": _ref(o)}))
    if sc.background != "white" and not any(c.type == "background_colour" for c in chosen):
        chosen.insert(0, Constraint("background_colour", {"colour": sc.background}))
    chosen.sort(key=lambda c: c.type != "background_colour")  # the background clause leads the prompt
    return sc.finish("hard", task_id, chosen)




def generate_tasks(n: int, *, seed: int, level: str) -> list[Task]:
    """``n`` tasks of ``level`` ("easy" | "medium" | "hard"), deterministic for ``seed``.

    Seeds < 1000 are reserved for training and pretraining data; the benchmark splits use 1001-1003
    (``scripts/make_vvr_splits.py``).
    """
    if level not in LEVELS:
        raise ValueError(f"level: {level!r} is not allowed; allowed values: {', '.join(LEVELS)}")
    tasks = []
    for i in range(n):
        rng = random.Random(f"vvr:{level}:{seed}:{i}")
        task_id = f"{level}-{seed}-{i}"
        # a hard task's leading constraint type is drawn once, so types that need retries stay uniform
        primary = rng.choice(CONSTRAINT_TYPES)
        for _ in range(1000):
            try:
                if level == "hard":
                    tasks.append(_hard(rng, task_id, primary))
                else:
                    tasks.append(_easy(rng, task_id) if level == "easy" else _medium(rng, task_id))
                break
            except _Retry:
                continue
        else:  # pragma: no cover - the builders succeed within a few tries
            raise RuntimeError(f"could not generate task {task_id}")
    return tasks
