"""Candidate constraints: every constraint of a type that holds in a scene with the generator's margins.

One function per group of constraint types, looked up in ``_BY_TYPE``; each reads the shared facts of
the scene (:class:`Facts`: which objects a descriptor picks out uniquely, which pairs are related) and
returns constraints stricter than the verifier's thresholds (``K_GEN`` and friends in
``rewards.vvr.scene``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from rewards.vvr import predicates as P
from rewards.vvr.predicates import Box
from rewards.vvr.scene import (
    ALIGN_GEN,
    BETWEEN_BAND_GEN,
    BETWEEN_MARGIN_GEN,
    BIGGER_GEN,
    K_GEN,
    NEAREST_GEN,
    REGION_GEN,
    Scene,
    matches,
    ref_of,
)
from rewards.vvr.tasks import DIRECTIONS, REGIONS, Constraint, Obj


@dataclass
class Facts:
    """What the candidate functions share about one scene: objects, boxes and unique descriptors."""

    sc: Scene
    objs: list[Obj] = field(init=False)
    boxes: list[Box] = field(init=False)

    def __post_init__(self) -> None:
        self.objs = self.sc.objs
        self.boxes = [o.box for o in self.objs]
        idx = range(len(self.objs))
        self.uniq = [i for i in idx if self.count(ref_of(self.objs[i])) == 1]
        self.uniq_shape = [i for i in idx if self.count(ref_of(self.objs[i], "shape")) == 1]
        self.uniq_colour = [i for i in idx if self.count(ref_of(self.objs[i], "colour")) == 1]
        self.inside_pairs = {frozenset(p) for p in self.sc.inside}
        self.pairs = [(i, j) for i in self.uniq for j in self.uniq if i != j]
        self.free_pairs = [(i, j) for i, j in self.pairs if frozenset((i, j)) not in self.inside_pairs]
        self.full_distinct = self.distinct("colour", "shape")

    def count(self, ref: dict[str, str]) -> int:
        return sum(matches(ref, o) for o in self.objs)

    def ref(self, i: int, *keys: str) -> dict[str, str]:
        return ref_of(self.objs[i], *keys)

    def kind_refs(self) -> list[dict[str, str]]:
        """Distinct descriptors by shape, by colour, then by both, in object order."""
        return [r for keys in (("shape",), ("colour",), ("colour", "shape")) for r in self.distinct(*keys)]

    def distinct(self, *keys: str) -> list[dict[str, str]]:
        """The objects' distinct descriptors by ``keys``, in object order."""
        out: list[dict[str, str]] = []
        for o in self.objs:
            if ref_of(o, *keys) not in out:
                out.append(ref_of(o, *keys))
        return out

    def others(self, *skip: int) -> list[Box]:
        return [b for k, b in enumerate(self.boxes) if k not in skip]


def _exists(f: Facts, t: str) -> list[Constraint]:
    return [Constraint(t, {"ref": r}) for r in f.full_distinct]


def _absent(f: Facts, t: str) -> list[Constraint]:
    present_c, present_s = {o.colour for o in f.objs}, {o.shape for o in f.objs}
    # distractor descriptors: an absent combination of a present colour or a present shape
    return [Constraint(t, {"ref": {"colour": c, "shape": s}}) for c in f.sc.colours for s in f.sc.vocab.shapes
            if f.count({"colour": c, "shape": s}) == 0 and (c in present_c or s in present_s)]


def _exact_count(f: Facts, t: str) -> list[Constraint]:
    if t == "total_count":
        return [Constraint(t, {"n": len(f.objs)})]
    keys = {"count_shape": ("shape",), "count_colour": ("colour",), "count_colour_shape": ("colour", "shape")}[t]
    return [Constraint(t, {**r, "n": f.count(r)}) for r in f.distinct(*keys)]


def _bound(f: Facts, t: str) -> list[Constraint]:
    if t == "at_least":
        return [Constraint(t, {"ref": r, "n": k}) for r in f.kind_refs() for k in range(2, f.count(r) + 1)]
    return [Constraint(t, {"ref": r, "n": k}) for r in f.kind_refs() for k in range(max(1, f.count(r)), 4)]


def _compare_counts(f: Facts, t: str) -> list[Constraint]:
    refs = f.kind_refs()
    holds = (lambda m, n: m > n) if t == "more_than" else (lambda m, n: m == n)
    out = [Constraint(t, {"a": a, "b": b}) for a in refs for b in refs
           if a != b and set(a) == set(b) and holds(f.count(a), f.count(b))]
    if t == "more_than":  # "more circles than hexagons" with no hexagon at all
        out += [Constraint(t, {"a": f.ref(0, "shape"), "b": {"shape": s}})
                for s in f.sc.vocab.shapes if f.objs and f.count({"shape": s}) == 0]
    return out


def _attribute(f: Facts, t: str) -> list[Constraint]:
    o = f.objs
    if t == "colour_of":
        return [Constraint(t, {"ref": f.ref(i, "shape"), "colour": o[i].colour}) for i in f.uniq_shape]
    if t == "shape_of":
        return [Constraint(t, {"ref": f.ref(i, "colour"), "shape": o[i].shape}) for i in f.uniq_colour]
    if t == "size_class":
        return [Constraint(t, {"ref": f.ref(i), "size": o[i].size}) for i in f.uniq]
    return [Constraint(t, {"ref": f.ref(i), "filled": o[i].filled}) for i in f.uniq]  # "filled"


def _same(f: Facts, t: str) -> list[Constraint]:
    o = f.objs
    if t == "same_shape":
        return [Constraint(t, {"a": f.ref(i, "colour"), "b": f.ref(j, "colour")}) for i in f.uniq_colour
                for j in f.uniq_colour if i < j and o[i].shape == o[j].shape]
    same = t == "same_colour"
    return [Constraint(t, {"a": f.ref(i, "shape"), "b": f.ref(j, "shape")}) for i in f.uniq_shape
            for j in f.uniq_shape if i < j and (o[i].colour == o[j].colour) == same]


def _background(f: Facts, t: str) -> list[Constraint]:
    return [Constraint(t, {"colour": f.sc.background})]


_PAIR_TESTS: dict[str, Callable[[Facts, int, int], bool]] = {
    "bigger": lambda f, i, j: P.bigger(f.boxes[i], f.boxes[j], BIGGER_GEN),
    "left_of": lambda f, i, j: P.left_of(f.boxes[i], f.boxes[j], K_GEN),
    "right_of": lambda f, i, j: P.left_of(f.boxes[j], f.boxes[i], K_GEN),
    "above": lambda f, i, j: P.above(f.boxes[i], f.boxes[j], K_GEN),
    "below": lambda f, i, j: P.above(f.boxes[j], f.boxes[i], K_GEN),
    "horizontally_aligned": lambda f, i, j: i < j and P.horizontally_aligned(f.boxes[i], f.boxes[j], ALIGN_GEN),
    "vertically_aligned": lambda f, i, j: i < j and P.vertically_aligned(f.boxes[i], f.boxes[j], ALIGN_GEN),
    "nearest_to": lambda f, i, j: len(f.objs) >= 3 and P.nearest_to(f.boxes[i], f.boxes[j], f.others(i, j), NEAREST_GEN),
}


def _pair_relation(f: Facts, t: str) -> list[Constraint]:
    # "bigger" may hold between an inner object and its container; spatial relations may not
    pairs = f.pairs if t == "bigger" else f.free_pairs
    return [Constraint(t, {"a": f.ref(i), "b": f.ref(j)}) for i, j in pairs if _PAIR_TESTS[t](f, i, j)]


def _structured(f: Facts, t: str) -> list[Constraint]:
    laid_out = {"inside": f.sc.inside, "touching": f.sc.touching, "overlapping": f.sc.overlap}[t]
    return [Constraint(t, {"a": f.ref(i), "b": f.ref(j)}) for i, j in laid_out if i in f.uniq and j in f.uniq]


def _between(f: Facts, t: str) -> list[Constraint]:
    u, b = f.uniq, f.boxes
    return [Constraint(t, {"a": f.ref(i), "b": f.ref(j), "c": f.ref(k)}) for i in u for j in u for k in u
            if len({i, j, k}) == 3 and j < k and not {frozenset((i, j)), frozenset((i, k))} & f.inside_pairs
            and P.between(b[i], b[j], b[k], BETWEEN_MARGIN_GEN, BETWEEN_BAND_GEN)]


def _extremal(f: Facts, t: str) -> list[Constraint]:
    return [Constraint(t, {"ref": f.ref(i), "direction": d}) for i in f.uniq for d in DIRECTIONS
            if len(f.objs) >= 2 and P.extremal(f.boxes[i], f.others(i), d, K_GEN)]


def _region(f: Facts, t: str) -> list[Constraint]:
    return [Constraint(t, {"ref": f.ref(i), "region": r}) for i in f.uniq for r in REGIONS
            if P.in_region(f.boxes[i], r, REGION_GEN)]


_GROUPS: dict[Callable[[Facts, str], list[Constraint]], tuple[str, ...]] = {
    _exists: ("exists",),
    _absent: ("absent",),
    _exact_count: ("count_shape", "count_colour", "count_colour_shape", "total_count"),
    _bound: ("at_least", "at_most"),
    _compare_counts: ("more_than", "equal_count"),
    _attribute: ("colour_of", "shape_of", "size_class", "filled"),
    _same: ("same_colour", "different_colour", "same_shape"),
    _background: ("background_colour",),
    _pair_relation: tuple(_PAIR_TESTS),
    _structured: ("inside", "touching", "overlapping"),
    _between: ("between",),
    _extremal: ("extremal",),
    _region: ("region",),
}
#: constraint type → the function listing its candidates
_BY_TYPE: dict[str, Callable[[Facts, str], list[Constraint]]] = {t: fn for fn, types in _GROUPS.items() for t in types}


def candidates(sc: Scene, ctype: str) -> list[Constraint]:
    """Every constraint of ``ctype`` that holds in ``sc`` with the generator's margins."""
    if ctype not in _BY_TYPE:
        raise ValueError(f"unknown constraint type {ctype!r}")
    return _BY_TYPE[ctype](Facts(sc), ctype)
