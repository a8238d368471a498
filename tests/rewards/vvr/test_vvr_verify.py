"""VVR verifier properties (method page): soundness, specificity, determinism, bad input, speed."""

from __future__ import annotations

import io
import math
import time
from dataclasses import replace

import numpy as np
import pytest
import torch
from PIL import Image, ImageFilter

from rewards.vvr import CONSTRAINT_TYPES, Constraint, Obj, Task, generate_tasks, render, verify
from rewards.vvr.generate import can_outline
from rewards.vvr.geometry import NOT_SMALL
from rewards.vvr.verify import score

SIZES = (64, 128, 512)


def _jpeg(img: Image.Image) -> Image.Image:
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=75)
    return Image.open(io.BytesIO(buf.getvalue())).convert("RGB")


def _blur(img: Image.Image) -> Image.Image:
    return img.filter(ImageFilter.GaussianBlur(0.6 * img.size[0] / 64))


DEGRADE = {"clean": lambda im: im, "jpeg": _jpeg, "blur": _blur}


def _sample_per_type(per_type: int = 2) -> list[Task]:
    """A few generated tasks holding each of the 32 types, plus easy and medium ones."""
    chosen: dict[str, Task] = {}
    counts = dict.fromkeys(CONSTRAINT_TYPES, 0)
    for t in generate_tasks(400, seed=21, level="hard"):
        if any(counts[c.type] < per_type for c in t.constraints):
            chosen[t.id] = t
            for c in t.constraints:
                counts[c.type] += 1
    assert min(counts.values()) >= per_type, counts
    return list(chosen.values()) + generate_tasks(4, seed=21, level="easy") + generate_tasks(8, seed=21, level="medium")


SOUND_TASKS = _sample_per_type()


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("variant", list(DEGRADE))
def test_soundness_rendered_tasks_pass_every_constraint(size, variant):
    failures = []
    for t in SOUND_TASKS:
        v = verify(t, DEGRADE[variant](render(t, size)))
        assert v.valid, v.reason
        failures += [(t.id, kind, t.prompt, v.detected) for kind, ok in v.constraints if not ok]
    assert not failures, failures[:3]


def test_soundness_covers_all_32_types():
    assert {c.type for t in SOUND_TASKS for c in t.constraints} == set(CONSTRAINT_TYPES)


# --- specificity: falsify one constraint by one mutation of the scene ------------------------------


def _matches(ref: dict, o: Obj) -> bool:
    return all(getattr(o, k) == v for k, v in ref.items())


def _fresh_colour(task: Task) -> str:
    used = {o.colour for o in task.objects} | {task.background}
    return next(c for c in ("red", "blue", "green", "orange", "purple", "cyan", "pink", "yellow") if c not in used)


def _other_shape(o: Obj, avoid: set[str]) -> str:
    return next(s for s in ("circle", "square", "star", "triangle") if s != o.shape and s not in avoid)


def _falsify(task: Task, c: Constraint) -> tuple[Task, set[int]] | None:
    """``task`` changed in one attribute or position so that ``c`` no longer holds; the touched objects."""
    objs = list(task.objects)
    a = c.args
    idx = {k: next((i for i, o in enumerate(objs) if _matches(a[k], o)), None) for k in ("ref", "a", "b", "c") if k in a}

    def done(changed: set[int], **task_changes) -> tuple[Task, set[int]]:
        return replace(task, objects=tuple(objs), **task_changes), changed

    def move(i: int, x: float, y: float) -> None:
        objs[i] = replace(objs[i], x=min(0.85, max(0.15, x)), y=min(0.85, max(0.15, y)))

    t = c.type
    if t in ("exists", "at_least", "count_shape", "count_colour", "count_colour_shape", "more_than", "equal_count",
             "total_count"):
        ref = a.get("ref") or a.get("a") or {k: a[k] for k in ("colour", "shape") if k in a}
        hit = [i for i, o in enumerate(objs) if _matches(ref, o)]
        drop = set(hit if t in ("exists", "at_least", "more_than") else hit[:1])
        changed = drop
        objs = [o for i, o in enumerate(objs) if i not in drop]
        return done(changed)
    if t in ("absent", "at_most"):
        ref = a["ref"]
        if t == "at_most" and len(objs) <= a["n"]:
            return None
        targets = [i for i, o in enumerate(objs) if not _matches(ref, o)][: (1 if t == "absent" else a["n"] + 1)]
        for i in targets:
            objs[i] = replace(objs[i], filled=True, size="medium", **ref)
        return done(set(targets))
    if t == "background_colour":  # a new background no object shares
        free = [bg for bg in ("white", "black", "gray") if bg not in {o.colour for o in objs} | {task.background}]
        return done(set(), background=free[0]) if free else None
    i = idx.get("ref", idx.get("a"))
    o = objs[i]
    if t in ("colour_of", "same_colour"):
        j = idx.get("b", i)
        objs[j] = replace(objs[j], colour=_fresh_colour(task))
        return done({j})
    if t == "different_colour":
        objs[idx["b"]] = replace(objs[idx["b"]], colour=o.colour)
        return done({idx["b"]})
    if t in ("shape_of", "same_shape"):
        j = idx.get("b", i)
        objs[j] = replace(objs[j], shape=_other_shape(objs[j], {o.shape}), size="medium")
        return done({j})
    if t == "size_class":
        size = {"small": "medium", "medium": "large", "large": "medium"}[o.size]
        objs[i] = replace(o, size=size)
        return done({i})
    if t == "bigger":
        j = idx["b"]
        if o.shape in NOT_SMALL or objs[j].shape in NOT_SMALL and o.size == "small":
            return None
        objs[i], objs[j] = replace(o, size=objs[j].size), replace(objs[j], size=o.size)
        return done({i, j})
    if t == "filled":
        if o.filled and not can_outline(o.shape, o.size):
            return None
        objs[i] = replace(o, filled=not o.filled)
        return done({i})
    if t in ("left_of", "right_of", "between", "extremal", "nearest_to") or t in ("above", "below"):
        # swap places with another object: the one that makes the relation false
        if t == "extremal":
            axis = "x" if a["direction"] in ("leftmost", "rightmost") else "y"
            sign = 1 if a["direction"] in ("leftmost", "topmost") else -1
            j = max((k for k in range(len(objs)) if k != i), key=lambda k: sign * getattr(objs[k], axis))
        elif t == "nearest_to":
            i, j = idx["b"], max((k for k in range(len(objs)) if k not in (idx["a"], idx["b"])),
                                 key=lambda k: math.dist((objs[k].x, objs[k].y), (objs[idx["a"]].x, objs[idx["a"]].y)))
        else:
            j = idx["b"]
        objs[i], objs[j] = replace(objs[i], x=objs[j].x, y=objs[j].y), replace(objs[j], x=objs[i].x, y=objs[i].y)
        return done({i, j})
    if t in ("horizontally_aligned", "vertically_aligned"):
        d = 0.15 if (o.y if t.startswith("h") else o.x) < 0.5 else -0.15
        move(i, o.x + (0 if t.startswith("h") else d), o.y + (d if t.startswith("h") else 0))
        return done({i})
    if t == "region":
        move(i, 1 - o.x, 1 - o.y)
        return done({i})
    if t in ("inside", "touching", "overlapping"):
        b = objs[idx["b"]]
        dx, dy = o.x - b.x, o.y - b.y
        norm = math.hypot(dx, dy) or 1.0
        step = 0.2 if t != "inside" else 0.18
        dx, dy = (dx / norm, dy / norm) if t != "inside" else (1.0 if b.x < 0.5 else -1.0, 0.0)
        # move A away from B, or B away from A when A sits against the border
        mover, sign = (i, 1) if 0.15 <= o.x + step * dx <= 0.85 and 0.15 <= o.y + step * dy <= 0.85 else (idx["b"], -1)
        move(mover, objs[mover].x + sign * step * dx, objs[mover].y + sign * step * dy)
        return done({mover})
    raise AssertionError(t)


def _gap(a: Obj, b: Obj) -> float:
    ba, bb = a.box, b.box
    return max(abs(ba.cx - bb.cx) - (ba.w + bb.w) / 2, abs(ba.cy - bb.cy) - (ba.h + bb.h) / 2)


def _new_contacts(before: Task, after: Task) -> bool:
    """Whether the mutation brought two objects that were apart into (near) contact."""
    if len(before.objects) != len(after.objects):
        return False
    n = len(after.objects)
    return any(_gap(before.objects[i], before.objects[j]) > 0.05 and _gap(after.objects[i], after.objects[j]) < 0.03
               for i in range(n) for j in range(i + 1, n))


def _global(c: Constraint) -> bool:
    return c.type in ("total_count", "nearest_to", "extremal", "between", "background_colour")


def _involves(c: Constraint, before: Task, after: Task, changed: set[int]) -> bool:
    """Whether ``c`` could depend on the changed objects (by descriptor, before or after the change)."""
    if _global(c):
        return True
    refs = [c.args[k] for k in ("ref", "a", "b", "c") if k in c.args]
    refs += [{k: c.args[k] for k in ("colour", "shape") if k in c.args}] if c.type.startswith("count") else []
    touched = [before.objects[i] for i in changed if i < len(before.objects)]
    touched += [after.objects[i] for i in changed if i < len(after.objects)]
    return any(_matches(r, o) for r in refs for o in touched)


@pytest.mark.parametrize("ctype", CONSTRAINT_TYPES)
def test_specificity_one_mutation_flips_that_constraint(ctype):
    tried = 0
    for task in SOUND_TASKS:
        for k, c in enumerate(task.constraints):
            if c.type != ctype:
                continue
            out = _falsify(task, c)
            if out is None or _new_contacts(task, out[0]):
                continue  # no single-step mutation, or one that would make objects collide
            mutated, changed = out
            before = verify(task, render(task, 128))
            after = verify(mutated, render(mutated, 128))
            assert before.constraints[k] == (ctype, True)
            assert after.constraints[k] == (ctype, False), (task.prompt, mutated.to_dict()["objects"], after.detected)
            for j, (c2, (_, ok)) in enumerate(zip(task.constraints, after.constraints)):
                if j != k and not _involves(c2, task, mutated, changed):
                    assert ok, (f"{c2.type} changed", task.prompt, after.detected)
            tried += 1
    assert tried >= 1


def test_specificity_recolour_and_move_by_hand():
    task = Task(
        "hand", "hard", "white",
        (Obj(0, "circle", "red", "medium", True, 0.25, 0.3), Obj(1, "square", "blue", "medium", True, 0.75, 0.3),
         Obj(2, "triangle", "green", "medium", True, 0.5, 0.75)),
        tuple(Constraint(t, a) for t, a in [
            ("exists", {"ref": {"colour": "red", "shape": "circle"}}),
            ("left_of", {"a": {"colour": "red", "shape": "circle"}, "b": {"colour": "blue", "shape": "square"}}),
            ("horizontally_aligned", {"a": {"colour": "red", "shape": "circle"}, "b": {"colour": "blue", "shape": "square"}}),
            ("above", {"a": {"colour": "blue", "shape": "square"}, "b": {"colour": "green", "shape": "triangle"}}),
            ("region", {"ref": {"colour": "red", "shape": "circle"}, "region": "top-left"}),
            ("total_count", {"n": 3}),
        ]),
    )
    assert verify(task, render(task, 64)).all_passed
    recoloured = replace(task, objects=(replace(task.objects[0], colour="orange"),) + task.objects[1:])
    assert [ok for _, ok in verify(recoloured, render(recoloured, 64)).constraints] == [False, False, False, True, False, True]
    lowered = replace(task, objects=(replace(task.objects[0], y=0.55),) + task.objects[1:])
    assert [ok for _, ok in verify(lowered, render(lowered, 64)).constraints] == [True, True, False, True, False, True]


# --- determinism, inputs -----------------------------------------------------------------------------


def test_verdict_is_deterministic_and_input_forms_agree():
    t = SOUND_TASKS[0]
    img = _jpeg(render(t, 96))
    arr = np.asarray(img)
    forms = [img, arr, arr.astype(np.float32) / 255, torch.from_numpy(arr.copy()).permute(2, 0, 1).float() / 255]
    verdicts = [verify(t, x) for x in forms] + [verify(t.to_dict(), img)]
    assert all(v.constraints == verdicts[0].constraints and v.score == verdicts[0].score for v in verdicts)
    assert all(v.detected == verdicts[0].detected for v in verdicts)


def test_works_at_1024_px():
    t = generate_tasks(1, seed=8, level="hard")[0]
    assert verify(t, render(t, 1024)).all_passed


def test_score_formula():
    assert score([True, True]) == 1.0 and score([False, False]) == 0.0
    assert score([True, False]) == pytest.approx(0.5 * 0.5)
    assert score([True, True, True, False]) == pytest.approx(0.5 * 0.75)


@pytest.mark.parametrize(
    "image, reason",
    [
        (np.full((64, 64, 3), 255, np.uint8), "blank"),
        (Image.new("RGB", (64, 64), (30, 60, 200)), "blank"),
        (np.zeros((64, 64), np.uint8), "grayscale"),
        (np.zeros((64, 64, 1), np.float32), "grayscale"),
        (Image.new("L", (64, 64)), "grayscale"),
        (torch.rand(1, 64, 64), "grayscale"),
        (torch.rand(2, 3, 64, 64), "shape"),
        (np.zeros((64, 64, 5), np.uint8), "shape"),
        (np.full((64, 64, 3), np.nan, np.float32), "NaN"),
        (np.zeros((8, 8, 3), np.uint8), "too small"),
        ("not an image", "unreadable"),
    ],
)
def test_bad_images_give_an_invalid_verdict_with_a_reason(image, reason):
    t = SOUND_TASKS[0]
    v = verify(t, image)
    assert not v.valid and v.score == 0.0 and not v.all_passed and reason in v.reason
    assert [k for k, _ in v.constraints] == [c.type for c in t.constraints]


def test_malformed_task_raises_value_error():
    d = SOUND_TASKS[0].to_dict()
    d["constraints"][0]["type"] = "left_off"
    with pytest.raises(ValueError, match="left_off"):
        verify(d, render(SOUND_TASKS[0], 64))


def test_verify_time_is_printed():
    tasks = generate_tasks(30, seed=9, level="hard")
    for size in (64, 128, 512):
        images = [render(t, size) for t in tasks]
        t0 = time.perf_counter()
        for t, im in zip(tasks, images):
            verify(t, im)
        print(f"\nverify: {(time.perf_counter() - t0) / len(tasks) * 1e3:.1f} ms per {size} px hard scene")


def test_a_blob_fainter_than_the_noise_matches_no_shape():
    """A faint smudge squashes to nothing; 0/0 against empty templates once gave NaN IoUs (seen on a tiny
    model's hard sample), and a NaN would win the argmax."""
    from rewards.vvr.segment import _classify

    cover = np.zeros((12, 13))
    cover[4:9, 12] = [0.04, 0.05, 0.07, 0.06, 0.06]  # half a pixel of colour, all below the noise floor
    with np.errstate(invalid="raise", divide="raise"):
        shape, _, _ = _classify(cover, np.ones_like(cover, dtype=bool), (2, 10, 2, 11))
    assert shape is None


def test_an_object_hidden_on_every_pixel_reads_as_no_shape_without_nan():
    """An object whose every pixel is claimed by others has zero visible area: no shape, no 0/0 warning."""
    import warnings

    import numpy as np

    from rewards.vvr.segment import _classify

    cover = np.zeros((12, 12))
    cover[3:9, 3:9] = 1.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        shape, box, template = _classify(cover, np.zeros_like(cover, dtype=bool), (3, 9, 3, 9))
    assert shape is None and box == (3.0, 3.0, 9.0, 9.0) and not template.any()
