"""The project's own GenEval-style prompt set: GenEval's six tags over its classes and colours, with held-out
compositions, in GenEval's metadata format (one dict per prompt: ``tag``, ``include``, ``exclude``, ``prompt``).

The prompt forms and metadata are GenEval's; the draws, the held-out compositions and the splits are this
project's. Held out of every training draw (and alone making up the ``test`` split), as VVR holds out
compositions (``rewards.vvr.heldout``):

* single objects: every fourth class (indices 0, 4, 8, ...) alone; these classes still appear in training
  next to other objects, in counts and with colours;
* class × colour: class ``i`` with colour ``(10 - i) mod 10``, so each class misses one colour and each
  colour eight classes (``colors``, ``color_attr``);
* class × count: class ``i`` with the count ``n`` in 2..4 where ``i + n`` is a multiple of 6;
* class pairs: the unordered pairs ``{i, j}`` with ``i + j`` a multiple of 13 (``two_object``, ``position``,
  ``color_attr``), whatever their order, sides or colours.

Every class, colour, count and relation still appears in training; only these combinations do not.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from rewards.geneval.vocabulary import CLASSES, COLOURS, NUMBERS, POSITIONS, TAGS, plural, with_article

_INDEX = {c: i for i, c in enumerate(CLASSES)}
HELDOUT_SINGLE: frozenset[str] = frozenset(CLASSES[::4])
HELDOUT_COLOURS: frozenset[tuple[str, str]] = frozenset((c, COLOURS[(10 - i) % 10]) for i, c in enumerate(CLASSES))
HELDOUT_COUNTS: frozenset[tuple[str, int]] = frozenset(
    (c, n) for i, c in enumerate(CLASSES) for n in (2, 3, 4) if (i + n) % 6 == 0)
HELDOUT_PAIRS: frozenset[frozenset[str]] = frozenset(
    frozenset((a, b)) for i, a in enumerate(CLASSES) for j, b in enumerate(CLASSES) if i < j and (i + j) % 13 == 0)
#: GenEval draws no "[colour] person" prompts
_COLOURABLE = tuple(c for c in CLASSES if c != "person")


def heldout_compositions(task: dict[str, Any]) -> list[str]:
    """The held-out compositions of one task, readable (empty: a training task)."""
    include = task["include"]
    found = []
    if task["tag"] == "single_object" and include[0]["class"] in HELDOUT_SINGLE:
        found.append(f"{include[0]['class']} alone")
    for req in include:
        if (req["class"], req.get("color")) in HELDOUT_COLOURS:
            found.append(f"{req['color']} {req['class']}")
        if task["tag"] == "counting" and (req["class"], req["count"]) in HELDOUT_COUNTS:
            found.append(f"{req['count']} {req['class']}")
    if len(include) == 2 and frozenset(r["class"] for r in include) in HELDOUT_PAIRS:
        found.append(" + ".join(sorted(r["class"] for r in include)))
    return found


def _single(rng: np.random.Generator) -> dict[str, Any]:
    cls = CLASSES[rng.integers(len(CLASSES))]
    return {"tag": "single_object", "include": [{"class": cls, "count": 1}], "prompt": f"a photo of {with_article(cls)}"}


def _two(rng: np.random.Generator) -> dict[str, Any]:
    a, b = (CLASSES[i] for i in rng.choice(len(CLASSES), 2, replace=False))
    return {"tag": "two_object", "include": [{"class": a, "count": 1}, {"class": b, "count": 1}],
            "prompt": f"a photo of {with_article(a)} and {with_article(b)}"}


def _counting(rng: np.random.Generator) -> dict[str, Any]:
    cls, n = CLASSES[rng.integers(len(CLASSES))], int(rng.integers(2, 5))
    return {"tag": "counting", "include": [{"class": cls, "count": n}], "exclude": [{"class": cls, "count": n + 1}],
            "prompt": f"a photo of {NUMBERS[n]} {plural(cls)}"}


def _colour(rng: np.random.Generator) -> dict[str, Any]:
    cls, colour = _COLOURABLE[rng.integers(len(_COLOURABLE))], COLOURS[rng.integers(len(COLOURS))]
    return {"tag": "colors", "include": [{"class": cls, "count": 1, "color": colour}],
            "prompt": f"a photo of {with_article(colour)} {cls}"}


def _position(rng: np.random.Generator) -> dict[str, Any]:
    a, b = (CLASSES[i] for i in rng.choice(len(CLASSES), 2, replace=False))
    relation = POSITIONS[rng.integers(len(POSITIONS))]
    # GenEval's form: the reference object first, the placed one second with [relation, 0]
    return {"tag": "position", "include": [{"class": b, "count": 1}, {"class": a, "count": 1, "position": [relation, 0]}],
            "prompt": f"a photo of {with_article(a)} {relation} {with_article(b)}"}


def _colour_attr(rng: np.random.Generator) -> dict[str, Any]:
    a, b = (_COLOURABLE[i] for i in rng.choice(len(_COLOURABLE), 2, replace=False))
    ca, cb = (COLOURS[i] for i in rng.choice(len(COLOURS), 2, replace=False))
    return {"tag": "color_attr",
            "include": [{"class": a, "count": 1, "color": ca}, {"class": b, "count": 1, "color": cb}],
            "prompt": f"a photo of {with_article(ca)} {a} and {with_article(cb)} {b}"}


DRAW: dict[str, Callable[[np.random.Generator], dict[str, Any]]] = {
    "single_object": _single, "two_object": _two, "counting": _counting, "colors": _colour, "position": _position,
    "color_attr": _colour_attr}
assert tuple(DRAW) == TAGS


def generate_tasks(n: int, seed: int = 0, heldout: str = "exclude", distinct: bool = False) -> list[dict[str, Any]]:
    """``n`` tasks, the six tags in turn (``ceil(n / 6)`` each at most); ``heldout="exclude"`` (training) redraws
    held-out tasks, ``"only"`` (test) keeps only them. ``distinct``: no prompt twice, so a tag with fewer
    distinct tasks (20 held-out single objects, 39 held-out counts) gives fewer."""
    rng = np.random.default_rng(seed)
    want_heldout = {"exclude": False, "only": True}[heldout]
    quota = -(-n // len(TAGS))
    per_tag: dict[str, list[dict[str, Any]]] = {tag: [] for tag in TAGS}
    seen: set[str] = set()
    for tag in TAGS:
        misses = 0
        while len(per_tag[tag]) < quota and misses < 2000:  # bounded: says when a tag has no more distinct tasks
            task = DRAW[tag](rng)
            if bool(heldout_compositions(task)) != want_heldout or (distinct and task["prompt"] in seen):
                misses += 1
                continue
            per_tag[tag].append(task)
            seen.add(task["prompt"])
    interleaved = [lists[k] for k in range(quota) for lists in per_tag.values() if k < len(lists)]
    return interleaved[:n]
