"""Seeded generation of VVR tasks: sample a scene, then pick constraints that are true in it.

Task ``i`` of ``generate_tasks(n, seed=s, level=l)`` is drawn from its own ``random.Random("vvr:l:s:i")``
(string seeds are hashed with SHA-512, not ``hash()``), so tasks are identical across runs and processes
and a longer list starts with the shorter one. Training tasks never hold a held-out composition
(``rewards.vvr.heldout``): such a draw is redrawn from the same generator; :func:`generate_heldout_tasks`
keeps only those draws (the test splits).

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

import random

from rewards.vvr.candidates import candidates
from rewards.vvr.heldout import is_heldout
from rewards.vvr.scene import (  # noqa: F401  (the layout margins and can_outline are re-exported)
    ALIGN_GEN,
    BETWEEN_BAND_GEN,
    BETWEEN_MARGIN_GEN,
    BIGGER_GEN,
    CONTRAST,
    EDGE,
    GAP,
    INSIDE_LUMA,
    K_GEN,
    NEAREST_GEN,
    PENETRATION,
    REGION_GEN,
    Retry,
    Scene,
    can_outline,
    matches,
    ref_of,
    sized,
)
from rewards.vvr.tasks import CONSTRAINT_TYPES, LEVELS, Constraint, Task
from rewards.vvr.vocabulary import (  # noqa: F401  (re-exported: the public names of this module)
    EASY_COLOURS,
    EASY_SHAPES,
    MEDIUM_COLOURS,
    MEDIUM_RELATIONS,
    MEDIUM_SHAPES,
    RELATIONS,
    VOCABULARIES,
    Vocabulary,
)

def _easy(rng: random.Random, task_id: str) -> Task:
    sc = Scene(rng, VOCABULARIES["easy"], "white")
    (i,) = sc.place([sc.new()])
    return sc.finish("easy", task_id, [Constraint("exists", {"ref": ref_of(sc.objs[i])})])


def _medium(rng: random.Random, task_id: str) -> Task:
    sc = Scene(rng, VOCABULARIES["medium"], "white")
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
            raise Retry
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
        sc.place([sized(o, rng.choice(["small", "medium"]))])
    o = sc.objs[0]
    args = {"count_colour_shape": {"colour": o.colour, "shape": o.shape}, "count_shape": {"shape": o.shape},
            "count_colour": {"colour": o.colour}, "total_count": {}}[kind]
    return sc.finish("medium", task_id, [Constraint(kind, {**args, "n": n})])


def _hard(rng: random.Random, task_id: str, primary: str) -> Task:
    vocab = VOCABULARIES["hard"]
    dark = primary == "background_colour" and rng.random() < 0.7 or rng.random() < 0.2
    sc = Scene(rng, vocab, rng.choice(vocab.backgrounds[1:]) if dark else "white")
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
            sc.place([sized(o, rng.choice(["small", "medium"]))])
    if rng.random() < 0.1 and structure is None and len(sc.objs) <= 2:
        sc.add_touching() if rng.random() < 0.5 else sc.add_inside()
    sc.fill(max(n, len(sc.objs)), outline=primary == "filled" or rng.random() < 0.15)

    found = candidates(sc, primary)
    if not found:
        raise Retry
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
            raise Retry
        chosen.append(rng.choice(options))
    if len(chosen) < 3:
        raise Retry
    # outlined objects are always said to be outlined; every object is named by some clause
    for o in sc.objs:
        if not o.filled and not any(c.type == "filled" and matches(c.args["ref"], o) for c in chosen):
            chosen.append(Constraint("filled", {"ref": ref_of(o), "filled": False}))
    named = [r for c in chosen for k, r in c.args.items() if k in ("ref", "a", "b", "c") and len(r) == 2]
    named += [{"colour": c.args["colour"], "shape": c.args["shape"]} for c in chosen if c.type == "count_colour_shape"]
    for o in sc.objs:
        if not any(matches(r, o) for r in named):
            named.append(ref_of(o))
            chosen.append(Constraint("exists", {"ref": ref_of(o)}))
    if sc.background != "white" and not any(c.type == "background_colour" for c in chosen):
        chosen.insert(0, Constraint("background_colour", {"colour": sc.background}))
    chosen.sort(key=lambda c: c.type != "background_colour")  # the background clause leads the prompt
    return sc.finish("hard", task_id, chosen)


def _draw(level: str, seed: int, i: int, exclude_heldout: bool) -> Task:
    """Task ``i`` of ``level`` for ``seed``; with ``exclude_heldout`` a held-out draw is drawn again."""
    rng = random.Random(f"vvr:{level}:{seed}:{i}")
    task_id = f"{level}-{seed}-{i}"
    # a hard task's leading constraint type is drawn once, so types that need retries stay uniform
    primary = rng.choice(CONSTRAINT_TYPES)
    for _ in range(1000):
        try:
            if level == "hard":
                task = _hard(rng, task_id, primary)
            else:
                task = _easy(rng, task_id) if level == "easy" else _medium(rng, task_id)
        except Retry:
            continue
        if not (exclude_heldout and is_heldout(task.constraints)):
            return task
    raise RuntimeError(f"could not generate task {task_id}")  # pragma: no cover - a few tries suffice


def _check_level(level: str) -> None:
    if level not in LEVELS:
        raise ValueError(f"level: {level!r} is not allowed; allowed values: {', '.join(LEVELS)}")


def generate_tasks(n: int, *, seed: int, level: str, exclude_heldout: bool = True) -> list[Task]:
    """``n`` tasks of ``level`` ("easy" | "medium" | "hard"), deterministic for ``seed``.

    ``exclude_heldout`` (the default, for training data) redraws every task that holds a held-out
    composition (``rewards.vvr.heldout``), so no training prompt is a test prompt. Seeds < 1000 are
    for training; the shipped splits use 1001-1003 (test) and 1101-1103 (validation).
    """
    _check_level(level)
    return [_draw(level, seed, i, exclude_heldout) for i in range(n)]


def generate_heldout_tasks(n: int, *, seed: int, level: str) -> list[Task]:
    """``n`` tasks of ``level`` that hold a held-out composition: the draws ``generate_tasks`` excludes
    (task ids keep the draw's index, so they show which draws were kept)."""
    _check_level(level)
    tasks: list[Task] = []
    i = 0
    while len(tasks) < n:
        task = _draw(level, seed, i, exclude_heldout=False)
        if is_heldout(task.constraints):
            tasks.append(task)
        i += 1
    return tasks
