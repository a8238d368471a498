"""The compositions VVR holds out of training: test prompts combine things no training prompt combines.

A task is *held out* when any of its clauses holds one of these compositions:

* a colour × shape pair of ``HELDOUT_PAIRS`` named as one object ("a red circle", "the green square is
  left of ..."), at any level. The pairs are the diagonal of the easy vocabulary: colour ``i`` of
  ``EASY_COLOURS`` with shape ``i mod 4`` of ``EASY_SHAPES``, so every colour and every shape still
  appears in training, only not together;
* a relation between two shapes in ``HELDOUT_RELATIONS`` (whatever their colours). Relations are compared
  in a canonical form, so "A is right of B" is "B is left of A", "A is below B" is "B is above A", and
  the symmetric relations (touching, aligned) ignore the order;
* an exact count of a shape in ``HELDOUT_COUNTS`` ("exactly three circles", "exactly two red squares").

The predicate reads only the constraints, so it is a function of the prompt: a prompt is held out or
not whatever scene it was drawn with. ``generate_tasks(..., exclude_heldout=True)`` (the default, used
for training data) redraws every held-out task; the test splits hold only held-out tasks.
"""

from __future__ import annotations

from typing import Iterable, Mapping

from rewards.vvr.tasks import Constraint
from rewards.vvr.vocabulary import EASY_COLOURS, EASY_SHAPES

#: colour × shape pairs no training prompt names as one object
HELDOUT_PAIRS: frozenset[tuple[str, str]] = frozenset(
    (colour, EASY_SHAPES[i % len(EASY_SHAPES)]) for i, colour in enumerate(EASY_COLOURS))
#: (relation, shape of A, shape of B) in canonical form (see ``canonical_relation``)
HELDOUT_RELATIONS: frozenset[tuple[str, str, str]] = frozenset({
    ("left_of", "circle", "square"), ("left_of", "triangle", "hexagon"),
    ("above", "star", "circle"), ("above", "square", "rectangle"),
    ("bigger", "hexagon", "triangle"), ("bigger", "square", "star"),
    ("inside", "star", "circle"), ("inside", "triangle", "square"),
    ("touching", "circle", "triangle"), ("touching", "square", "star"),
    ("horizontally_aligned", "circle", "star"), ("vertically_aligned", "square", "triangle"),
    ("overlapping", "circle", "hexagon"), ("nearest_to", "triangle", "circle"),
})
#: (shape, n) of exact counts no training prompt asks for
HELDOUT_COUNTS: frozenset[tuple[str, int]] = frozenset({
    ("circle", 3), ("square", 2), ("triangle", 3), ("star", 2), ("hexagon", 3), ("rectangle", 2),
})

_MIRRORED = {"right_of": "left_of", "below": "above"}
_SYMMETRIC = frozenset({"touching", "horizontally_aligned", "vertically_aligned"})


def canonical_relation(ctype: str, shape_a: str, shape_b: str) -> tuple[str, str, str]:
    """``(relation, shape A, shape B)`` with mirrored relations turned round and symmetric ones sorted."""
    if ctype in _MIRRORED:
        return _MIRRORED[ctype], shape_b, shape_a
    if ctype in _SYMMETRIC:
        return (ctype, *sorted((shape_a, shape_b)))  # type: ignore[return-value]
    return ctype, shape_a, shape_b


def _refs(c: Constraint) -> Iterable[Mapping[str, str]]:
    return (v for k, v in c.args.items() if k in ("ref", "a", "b", "c"))


def heldout_compositions(constraints: Iterable[Constraint]) -> list[str]:
    """The held-out compositions the constraints hold, as readable strings (empty: a training prompt)."""
    found = []
    for c in constraints:
        pairs = [(r["colour"], r["shape"]) for r in _refs(c) if "colour" in r and "shape" in r]
        if c.type == "count_colour_shape":
            pairs.append((c.args["colour"], c.args["shape"]))
        found += [f"{colour} {shape}" for colour, shape in pairs if (colour, shape) in HELDOUT_PAIRS]
        a, b = c.args.get("a", {}), c.args.get("b", {})
        if "shape" in a and "shape" in b and canonical_relation(c.type, a["shape"], b["shape"]) in HELDOUT_RELATIONS:
            found.append(" ".join(canonical_relation(c.type, a["shape"], b["shape"])))
        if c.type in ("count_shape", "count_colour_shape") and (c.args["shape"], c.args["n"]) in HELDOUT_COUNTS:
            found.append(f"exactly {c.args['n']} {c.args['shape']}")
    return found


def is_heldout(constraints: Iterable[Constraint]) -> bool:
    """Whether a task with these constraints belongs to the held-out (test) compositions."""
    return bool(heldout_compositions(constraints))
