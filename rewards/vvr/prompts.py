"""Deterministic prompt templates: one clause per constraint, joined with "; ".

One template family for every level, lower case, no final full stop:

* easy: ``"a red circle"``
* medium: ``"the red circle is left of the blue square"`` or ``"exactly two green stars"``
* hard: ``"on a black background, the yellow star is inside the blue hexagon; exactly two circles; ..."``

A ``background_colour`` constraint becomes the prefix ``"on a <colour> background, "`` wherever it sits
in the constraint list.
"""

from __future__ import annotations

from typing import Any, Mapping, Protocol, Sequence


class Clause(Protocol):
    """What a prompt is made from: a constraint's ``type`` and ``args`` (``rewards.vvr.tasks.Constraint``)."""

    type: str
    args: Mapping[str, Any]

_NUMBERS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")
_PLURAL = {"circle": "circles", "square": "squares", "rectangle": "rectangles", "triangle": "triangles",
           "pentagon": "pentagons", "hexagon": "hexagons", "star": "stars", "ellipse": "ellipses"}


def _number(n: int) -> str:
    return _NUMBERS[n] if n < len(_NUMBERS) else str(n)


def noun(ref: Mapping[str, str], plural: bool = False) -> str:
    """``{"colour": "red", "shape": "circle"}`` → "red circle(s)"; a colour alone → "red object(s)"."""
    shape = ref.get("shape")
    head = (_PLURAL[shape] if plural else shape) if shape else ("objects" if plural else "object")
    return f"{ref['colour']} {head}" if "colour" in ref else head


def indefinite(ref: Mapping[str, str]) -> str:
    """"a red circle", "an orange star": the descriptor with its indefinite article."""
    text = noun(ref)
    return ("an " if text[0] in "aeiou" else "a ") + text


def definite(ref: Mapping[str, str]) -> str:
    """"the red circle": the descriptor with the definite article."""
    return "the " + noun(ref)


def _count(n: int, ref: Mapping[str, str]) -> str:
    return f"{_number(n)} {noun(ref, plural=n != 1)}"


_RELATION_WORDS = {
    "left_of": "is left of", "right_of": "is right of", "above": "is above", "below": "is below",
    "inside": "is inside", "touching": "touches", "overlapping": "overlaps", "bigger": "is bigger than",
}
#: what a pair of objects share: "the red circle and the blue square <words>"
_PAIR_WORDS = {
    "same_colour": "are the same colour", "different_colour": "are different colours",
    "same_shape": "are the same shape",
    "horizontally_aligned": "are horizontally aligned", "vertically_aligned": "are vertically aligned",
}
#: clauses about named objects: ``{ref}``, ``{a}``, ``{b}``, ``{c}`` stand for "the <colour> <shape>", every
#: other ``{arg}`` for the constraint's value
_OBJECT_TEMPLATES = {
    "colour_of": "{ref} is {colour}", "size_class": "{ref} is {size}", "extremal": "{ref} is the {direction} object",
    "between": "{a} is between {b} and {c}", "nearest_to": "the object nearest to {a} is {b}",
    **{t: "{a} " + words + " {b}" for t, words in _RELATION_WORDS.items()},
    **{t: "{a} and {b} " + words for t, words in _PAIR_WORDS.items()},
}
_OBJECT_ARGS = ("ref", "a", "b", "c")


def clause(c: Clause) -> str:
    """The prompt clause for one constraint."""
    t, a = c.type, c.args
    if t == "exists":
        return indefinite(a["ref"])
    if t == "absent":
        return f"no {noun(a['ref'], plural=True)}"
    if t in ("count_shape", "count_colour", "count_colour_shape"):
        ref = {k: a[k] for k in ("colour", "shape") if k in a}
        return "exactly " + _count(a["n"], ref)
    if t == "total_count":
        return f"exactly {_count(a['n'], {})} in total"
    if t == "at_least":
        return "at least " + _count(a["n"], a["ref"])
    if t == "at_most":
        return "at most " + _count(a["n"], a["ref"])
    if t == "more_than":
        return f"more {noun(a['a'], True)} than {noun(a['b'], True)}"
    if t == "equal_count":
        return f"as many {noun(a['a'], True)} as {noun(a['b'], True)}"
    if t in _OBJECT_TEMPLATES:
        return _OBJECT_TEMPLATES[t].format(**{k: definite(v) if k in _OBJECT_ARGS else v for k, v in a.items()})
    if t == "shape_of":
        return f"{definite(a['ref'])} is {indefinite({'shape': a['shape']})}"
    if t == "filled":
        return f"{definite(a['ref'])} is {'filled' if a['filled'] else 'outlined'}"
    if t == "region":
        return f"{definite(a['ref'])} is in the {a['region'].replace('-', ' ')}"
    raise ValueError(f"no prompt template for constraint type {t!r}")


def prompt_for(constraints: Sequence[Clause]) -> str:
    """The task prompt: the background prefix (if any), then the other clauses joined by "; "."""
    background: Any = next((c.args["colour"] for c in constraints if c.type == "background_colour"), None)
    body = "; ".join(clause(c) for c in constraints if c.type != "background_colour")
    if background:
        return f"on a {background} background, {body}" if body else f"a {background} background"
    return body
