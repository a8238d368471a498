"""Near-miss scenes: a task's scene with one object changed, so that the verifier fails it.

A reward model learns to rank a generator's samples from pairs (chosen, rejected) of one prompt. The
generator's own samples give few pairs per minute on a CPU and, for a small prompt space, few prompts.
Rendered pairs are free and exactly labelled: the task's own scene passes (soundness), and the same scene
with one object's colour, shape, size or position changed, or the object dropped, is kept as the rejected image only when the
verifier scores it lower for the *same* task — the near misses a generator makes (a circle for a star,
the right objects in the wrong places).
"""

from __future__ import annotations

import random
from dataclasses import replace
from typing import Iterator, Sequence

from PIL import Image

from rewards.vvr.geometry import SHAPES, SIZES
from rewards.vvr.palette import COLOURS
from rewards.vvr.render import render
from rewards.vvr.tasks import Obj, Task
from rewards.vvr.verify import verify

MUTATIONS = ("position", "colour", "size", "shape", "drop")


def mutate_object(obj: Obj, kind: str, rng: random.Random, background: str | None = None) -> Obj:
    """``obj`` with its ``kind`` (``position``, ``colour``, ``size`` or ``shape``) changed to another value
    drawn from ``rng``; a new colour is never ``background`` (the object would vanish). Sizes and shapes
    the generator keeps apart (a small hexagon) may meet: the verifier labels whatever is drawn."""
    if kind == "position":
        return replace(obj, x=rng.uniform(0.15, 0.85), y=rng.uniform(0.15, 0.85))
    if kind == "colour":
        return replace(obj, colour=rng.choice([c for c in COLOURS if c not in (obj.colour, background)]))
    if kind == "size":
        return replace(obj, size=rng.choice([s for s in SIZES if s != obj.size]))
    if kind == "shape":
        return replace(obj, shape=rng.choice([s for s in SHAPES if s != obj.shape]))
    raise ValueError(f"unknown mutation {kind!r}; use one of {MUTATIONS}")


def mutate_scene(task: Task, rng: random.Random, kinds: Sequence[str] = MUTATIONS) -> Task:
    """``task`` with one scene object changed by one of ``kinds`` (``drop`` removes it, only when another
    object remains); the constraints stay as they were."""
    objects = list(task.objects)
    i = rng.randrange(len(objects))
    kind = rng.choice([k for k in kinds if k != "drop" or len(objects) > 1])
    if kind == "drop":
        objects.pop(i)
    else:
        objects[i] = mutate_object(objects[i], kind, rng, task.background)
    return replace(task, objects=tuple(objects))


def near_miss(task: Task, rng: random.Random, *, size: int = 64, tries: int = 8) -> tuple[Image.Image, float] | None:
    """A render of :func:`mutate_scene` of ``task`` that the verifier scores below 1 for ``task``, with that
    score; None when ``tries`` mutations all still pass."""
    for _ in range(tries):
        image = render(mutate_scene(task, rng), size)
        verdict = verify(task, image)
        if verdict.valid and not verdict.all_passed:
            return image, verdict.score
    return None


def rendered_pairs(tasks: list[Task], *, seed: int, size: int = 64, per_task: int = 1) -> Iterator[tuple[Task, Image.Image, Image.Image, float]]:
    """``(task, chosen, rejected, margin)`` per task and near miss: chosen is the task's own render
    (verified to pass), rejected a :func:`near_miss`, margin the score difference. Deterministic for
    ``seed``."""
    rng = random.Random(seed)
    for task in tasks:
        chosen = render(task, size)
        top = verify(task, chosen)
        if not top.all_passed:  # a scene too small to verify at this size: no exact label
            continue
        for _ in range(per_task):
            miss = near_miss(task, rng, size=size)
            if miss is not None:
                yield task, chosen, miss[0], top.score - miss[1]
