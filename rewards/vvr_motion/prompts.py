"""Deterministic prompt templates for motion tasks, lower case, no final full stop.

Constraints are grouped by their subject (the ``ref``/``a`` object), in the order subjects first occur
in the task. The first subject takes participles, the others finite verbs after "while"; a subject's
verbs are joined by "and"; an object already named (as a subject or as a target) is "the ...":

* easy: ``"a red circle moving to the right"``
* medium: ``"a red circle moving up while a blue square stays still"``,
  ``"an orange star moving to the left and growing"``
* hard: ``"a blue square moving toward the green star while a yellow triangle stays still and the
  green star shrinks"``
"""

from __future__ import annotations

from typing import Any, Mapping, Protocol, Sequence

from rewards.vvr.prompts import definite, indefinite


class MotionClause(Protocol):
    """What a prompt is made from (``rewards.vvr_motion.tasks.MotionConstraint``)."""

    type: str
    args: Mapping[str, Any]

    @property
    def refs(self) -> list[dict[str, str]]: ...


def ref_key(ref: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """A hashable key for an object descriptor (``{"colour": .., "shape": ..}``): the same object in every
    constraint that names it maps to the same key."""
    return tuple(sorted(ref.items()))


_PATH = {"left": "to the left", "right": "to the right", "up": "up", "down": "down"}
#: type → (participle, finite verb) phrase; ``{dir}`` and ``{b}`` are filled in
_VERBS: dict[str, tuple[str, str]] = {
    "moves": ("moving {dir}", "moves {dir}"),
    "still": ("staying still", "stays still"),
    "appears": ("appearing", "appears"),
    "grows": ("growing", "grows"),
    "shrinks": ("shrinking", "shrinks"),
    "toward": ("moving toward {b}", "moves toward {b}"),
    "away_from": ("moving away from {b}", "moves away from {b}"),
}


def prompt_for(constraints: Sequence[MotionClause]) -> str:
    """The task prompt (see the module docstring)."""
    subjects: dict[tuple[tuple[str, str], ...], list[MotionClause]] = {}
    for c in constraints:
        subjects.setdefault(ref_key(c.refs[0]), []).append(c)
    named: set[tuple[tuple[str, str], ...]] = set()
    parts = []
    for i, (key, group) in enumerate(subjects.items()):
        subject = definite(dict(key)) if key in named else indefinite(dict(key))
        named.add(key)
        verbs = []
        for c in group:
            b = c.args.get("b")
            phrase = _VERBS[c.type][i > 0].format(dir=_PATH.get(c.args.get("direction", ""), ""),
                                                  b=definite(b) if b else "")
            if b:
                named.add(ref_key(b))
            verbs.append(phrase)
        parts.append(f"{subject} {' and '.join(verbs)}")
    return parts[0] + ("" if len(parts) == 1 else " while " + " and ".join(parts[1:]))
