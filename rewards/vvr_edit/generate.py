"""Deterministic generator of VVR editing tasks, with held-out compositions for the benchmark splits.

A task is drawn from ``random.Random(f"vvr_edit:{level}:{seed}:{i}")``: a source scene of well separated
objects with unique (colour, shape) from the level's VVR vocabulary (easy: 2 objects, medium: 3, hard: 4), an
edit kind (cycled, so every kind is equally common), its arguments, and the edited scene. Moves and additions
place the object where the asked relation holds with a wide margin (``k = 0.3`` against the verifier's
0.1) and, for a move, where it did not hold before, so the unedited source always fails the instruction.

Held-out compositions: the (colour, shape) an edit produces or acts on (a recolour's new colour on its shape,
an added object, a moved or removed object) in :data:`HELDOUT_PAIRS` never occurs in training draws
(``heldout="exclude"``, seeds < 1000) and is the only one in the validation / test splits (``"only"``).
"""

from __future__ import annotations

import dataclasses
import random

from rewards.vvr import VOCABULARIES, Obj
from rewards.vvr.geometry import NOT_SMALL, SIZE_EXTENT, box_size
from rewards.vvr.predicates import Box, above, left_of
from rewards.vvr_edit.tasks import EDIT_KINDS, RELATIONS, EditTask

LEVELS = ("easy", "medium", "hard")
OBJECTS_PER_LEVEL = {"easy": 2, "medium": 3, "hard": 4}
#: compositions held out of training: they appear only in the validation and test splits
HELDOUT_PAIRS: frozenset[tuple[str, str]] = frozenset(
    {("blue", "star"), ("red", "square"), ("green", "triangle"), ("yellow", "circle")}
)
GAP = 0.08  # free space between object boxes (image fractions): JPEG ringing must not join two objects
OUTLINE_SHAPES = frozenset({"circle", "square", "rectangle", "hexagon", "ellipse"})
STRICT = 0.3  # relation margin the generator demands (the verifier's is 0.1)


def holds(relation: str, a: Box, b: Box, k: float = 0.1) -> bool:
    """The VVR box predicate of ``relation`` (left_of / right_of / above / below)."""
    if relation == "left_of":
        return left_of(a, b, k)
    if relation == "right_of":
        return left_of(b, a, k)
    if relation == "above":
        return above(a, b, k)
    return above(b, a, k)


def _apart(a: Box, b: Box) -> bool:
    return abs(a.cx - b.cx) > (a.w + b.w) / 2 + GAP or abs(a.cy - b.cy) > (a.h + b.h) / 2 + GAP


def _place(rng: random.Random, obj: Obj, others: list[Obj], ok=lambda box: True) -> Obj | None:
    """``obj`` at a random centre inside the canvas, clear of ``others`` and satisfying ``ok``; None if none found."""
    w, h = box_size(obj.shape, SIZE_EXTENT[obj.size])
    for _ in range(300):
        x = rng.uniform(w / 2 + 0.03, 1 - w / 2 - 0.03)
        y = rng.uniform(h / 2 + 0.03, 1 - h / 2 - 0.03)
        box = Box(x, y, w, h)
        if ok(box) and all(_apart(box, o.box) for o in others):
            return dataclasses.replace(obj, x=round(x, 4), y=round(y, 4))
    return None


def _new_object(rng: random.Random, level: str, oid: int, colours: list[str], taken: set) -> Obj:
    vocab = VOCABULARIES[level]
    while True:
        colour, shape = rng.choice(colours), rng.choice(vocab.shapes)
        if (colour, shape) not in taken:
            break
    sizes = [s for s in vocab.sizes if not (s == "small" and shape in NOT_SMALL)]
    size = rng.choice(sizes)
    # outlines only where a 64 px JPEG keeps them readable: not small, not thin-armed (stars, triangles)
    filled = not (vocab.outline and size != "small" and shape in OUTLINE_SHAPES and rng.random() < 0.3)
    return Obj(oid, shape, colour, size, filled, 0.5, 0.5)


def _scene(rng: random.Random, level: str) -> tuple[str, list[str], list[Obj]] | None:
    vocab = VOCABULARIES[level]
    background = rng.choice(vocab.backgrounds)
    colours = [c for c in vocab.colours if c != background]
    objects: list[Obj] = []
    for oid in range(OBJECTS_PER_LEVEL[level]):
        obj = _place(rng, _new_object(rng, level, oid, colours, {(o.colour, o.shape) for o in objects}), objects)
        if obj is None:
            return None
        objects.append(obj)
    return background, colours, objects


def _edit(rng: random.Random, kind: str, level: str, colours: list[str], objects: list[Obj]):
    """``(edit dict, result objects, composition)`` or None when this scene does not allow it."""
    taken = {(o.colour, o.shape) for o in objects}
    target = rng.choice(objects)
    rest = [o for o in objects if o.id != target.id]
    if kind == "recolour":
        options = [c for c in colours if c != target.colour and (c, target.shape) not in taken]
        colour = rng.choice(options)
        result = [dataclasses.replace(o, colour=colour) if o.id == target.id else o for o in objects]
        return {"kind": kind, "target": target.id, "colour": colour}, result, (colour, target.shape)
    if kind == "remove":
        return {"kind": kind, "target": target.id}, rest, (target.colour, target.shape)
    anchor = rng.choice(rest)
    if kind == "move":
        relations = [r for r in RELATIONS if not holds(r, target.box, anchor.box)]
        relation = rng.choice(relations)
        moved = _place(rng, target, rest, lambda box: holds(relation, box, anchor.box, STRICT))
        if moved is None:
            return None
        result = [moved if o.id == target.id else o for o in objects]
        return {"kind": kind, "target": target.id, "relation": relation, "anchor": anchor.id}, result, (
            target.colour, target.shape)
    relation = rng.choice(RELATIONS)
    new = _new_object(rng, level, max(o.id for o in objects) + 1, colours, taken)
    new = dataclasses.replace(new, size="medium")
    added = _place(rng, new, objects, lambda box: holds(relation, box, anchor.box, STRICT))
    if added is None:
        return None
    edit = {"kind": kind, "object": added.to_dict(), "relation": relation, "anchor": anchor.id}
    return edit, objects + [added], (added.colour, added.shape)


def generate_edit_tasks(n: int, *, seed: int, level: str, heldout: str = "exclude") -> list[EditTask]:
    """``n`` tasks of ``level``, deterministic for ``seed``; ``heldout``: ``"exclude"`` (training: no task
    acts on a held-out composition) or ``"only"`` (the splits: every task does)."""
    if level not in LEVELS:
        raise ValueError(f"level: {level!r} is not allowed; allowed values: {', '.join(LEVELS)}")
    if heldout not in ("exclude", "only"):
        raise ValueError(f"heldout: {heldout!r} must be 'exclude' or 'only'")
    tasks = []
    for i in range(n):
        rng = random.Random(f"vvr_edit:{level}:{seed}:{i}")
        kind = EDIT_KINDS[i % len(EDIT_KINDS)]
        while True:
            scene = _scene(rng, level)
            drawn = scene and _edit(rng, kind, level, scene[1], scene[2])
            if drawn and ((drawn[2] in HELDOUT_PAIRS) == (heldout == "only")):
                break
        edit, result, _ = drawn
        tasks.append(EditTask(f"{level}-{seed}-{i}", level, scene[0], tuple(scene[2]), edit, tuple(result)))
    return tasks
