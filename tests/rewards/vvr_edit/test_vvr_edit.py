"""vvr_edit: the generator, the verifier on rendered edits (correct ones pass under JPEG and blur, the unedited
source and wrong edits fail), one test per edit kind, held-out compositions, the reward and the benchmark."""

from __future__ import annotations

import dataclasses
import io
import json
import random

import numpy as np
import pytest
import torch
from PIL import Image, ImageFilter

import rewards
from flowalign.paths import assets_dir
from flowalign.benchmarks import load_benchmark, training_tasks
from rewards.vvr import render
from rewards.vvr_edit import (EDIT_KINDS, HELDOUT_PAIRS, EditTask, generate_edit_tasks, load_split, render_result,
                              render_source, verify_edit)
from rewards.vvr_edit.generate import _place, holds
from rewards.vvr_edit.tasks import scene_dict

OPPOSITE = {"left_of": "right_of", "right_of": "left_of", "above": "below", "below": "above"}


def jpeg(img: Image.Image) -> Image.Image:
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=75)
    return Image.open(io.BytesIO(buf.getvalue())).convert("RGB")


def blur(img: Image.Image) -> Image.Image:
    return img.filter(ImageFilter.GaussianBlur(0.6 * img.size[0] / 64))


def to_tensor(img: Image.Image) -> torch.Tensor:
    return torch.from_numpy(np.array(img)).permute(2, 0, 1) / 255.0


def draw(task: EditTask, objects, size: int = 64) -> Image.Image:
    return render(scene_dict(task, tuple(objects)), size=size)


def wrong_edit(task: EditTask, rng: random.Random) -> list:
    """The edit done wrong in the way its kind invites (wrong colour, wrong side, wrong object, wrong new object)."""
    e, result = task.edit, list(task.result)
    if task.kind == "recolour":
        src = task.by_id(e["target"])
        taken = {(o.colour, o.shape) for o in task.objects}
        colour = next(c for c in ("cyan", "pink", "brown", "orange", "purple", "red", "green")
                      if c not in (e["colour"], src.colour, task.background) and (c, src.shape) not in taken)
        return [dataclasses.replace(o, colour=colour) if o.id == src.id else o for o in result]
    if task.kind == "remove":
        keep = next(o for o in task.objects if o.id != e["target"])
        return [o for o in task.objects if o.id != keep.id]
    if task.kind == "move":
        target, anchor = task.by_id(e["target"]), task.by_id(e["anchor"])
        rest = [o for o in task.objects if o.id != target.id]
        moved = _place(rng, target, rest, lambda box: holds(OPPOSITE[e["relation"]], box, anchor.box, 0.3))
        return [moved if o.id == target.id else o for o in task.objects] if moved else list(task.objects)
    added = task.added
    colour = next(c for c in ("cyan", "pink", "brown", "black", "orange", "purple")
                  if c not in (added.colour, task.background) and (c, added.shape) not in {(o.colour, o.shape) for o in task.objects})
    return [dataclasses.replace(o, colour=colour) if o.id == added.id else o for o in result]


def collateral(task: EditTask) -> list:
    """The right edit, but an object the instruction does not name moved by a fifth of the image."""
    named = {task.edit.get("target"), task.edit.get("anchor")}
    bystanders = [o for o in task.result if o.id not in named and (task.added is None or o.id != task.added.id)]
    if not bystanders:
        return []
    b = bystanders[0]
    shifted = dataclasses.replace(b, x=b.x - 0.2 if b.x > 0.5 else b.x + 0.2)
    return [shifted if o.id == b.id else o for o in task.result]


@pytest.fixture(scope="module")
def tasks():
    return [t for level in ("easy", "medium", "hard") for t in generate_edit_tasks(40, seed=3, level=level)]


def test_correct_edits_pass_under_jpeg_and_blur(tasks):
    for degrade in (lambda im: im, jpeg, blur):
        passed = sum(verify_edit(t, degrade(render_result(t))).all_passed for t in tasks)
        assert passed / len(tasks) >= 0.98, (degrade, passed, len(tasks))


def test_source_and_wrong_edits_fail(tasks):
    rng = random.Random(0)
    source = sum(verify_edit(t, jpeg(render_source(t))).all_passed for t in tasks)
    wrong = sum(verify_edit(t, jpeg(draw(t, wrong_edit(t, rng)))).all_passed for t in tasks)
    moved = [(t, c) for t in tasks if (c := collateral(t))]
    bystander = sum(verify_edit(t, jpeg(draw(t, c))).all_passed for t, c in moved)
    assert len(moved) > len(tasks) / 3
    assert source / len(tasks) <= 0.10 and wrong / len(tasks) <= 0.10 and bystander / len(moved) <= 0.10, (
        source, wrong, bystander, len(tasks), len(moved))


@pytest.mark.parametrize("kind", EDIT_KINDS)
def test_each_edit_kind(kind):
    batch = [t for t in generate_edit_tasks(24, seed=5, level="medium") if t.kind == kind]
    assert len(batch) == 6
    words = {"recolour": "make the ", "move": "move the ", "remove": "remove the ", "add": "add "}[kind]
    rng = random.Random(1)
    for t in batch:
        assert t.prompt.startswith(words)
        ok = verify_edit(t, render_result(t, 128))
        assert ok.all_passed and ok.score == 1.0, (t.prompt, ok.constraints)
        bad = verify_edit(t, draw(t, wrong_edit(t, rng), 128))
        failed = {name for name, p in bad.constraints if not p}
        expected = {"recolour": {"exists"}, "move": {t.edit.get("relation")}, "remove": {"absent"},
                    "add": {"exists"}}[kind]
        assert expected <= failed or (kind == "remove" and "keeps" in failed), (t.prompt, bad.constraints)
    if kind == "add":
        assert all(len(t.result) == len(t.objects) + 1 for t in batch)
    if kind == "remove":
        assert all(len(t.result) == len(t.objects) - 1 for t in batch)


def test_heldout_compositions_split_training_from_evaluation():
    def composition(t):
        e = t.edit
        if t.kind == "recolour":
            return e["colour"], t.by_id(e["target"]).shape
        obj = t.added if t.kind == "add" else t.by_id(e["target"])
        return obj.colour, obj.shape

    train = generate_edit_tasks(80, seed=0, level="easy")
    assert not any(composition(t) in HELDOUT_PAIRS for t in train)
    for split in ("validation", "test"):
        shipped = load_split("easy", split)
        assert len(shipped) == 100 and all(composition(t) in HELDOUT_PAIRS for t in shipped)
    fresh = generate_edit_tasks(5, seed=1002, level="easy", heldout="only")
    assert [t.to_dict() for t in fresh] == [t.to_dict() for t in load_split("easy", "test", 5)]
    assert generate_edit_tasks(3, seed=0, level="hard")[0].to_dict() == generate_edit_tasks(3, seed=0, level="hard")[0].to_dict()
    line = (assets_dir() / "vvr_edit" / "hard" / "test.jsonl").read_text().splitlines()[0]
    assert EditTask.from_dict(json.loads(line)).prompt == json.loads(line)["prompt"]
    with pytest.raises(ValueError, match="edit.kind"):
        EditTask.from_dict({"edit": {"kind": "rotate"}})


def test_reward_and_benchmark():
    bench = load_benchmark("vvr_edit", "easy", n=4)
    assert bench.name == "vvr_edit-easy" and bench.reward.name == "vvr_edit"
    # the source scene, rendered on use
    assert all(isinstance(m["image"](), Image.Image) and "task" in m for m in bench.metadata)
    tasks = [EditTask.from_dict(m["task"]) for m in bench.metadata]
    good = torch.stack([to_tensor(render_result(t)) for t in tasks])
    out = bench.reward(good.float(), bench.prompts, bench.metadata)
    assert out.valid.all() and torch.equal(out.components["vvr_edit"], torch.ones(4))
    src = torch.stack([to_tensor(m["image"]().resize((64, 64))) for m in bench.metadata])
    out = rewards.load("vvr_edit")(src.float(), bench.prompts, bench.metadata)
    assert (out.components["vvr_edit"] < 1).all() and not any(i["all_passed"] for i in out.info)
    training = training_tasks("vvr_edit", "easy", n=4, seed=0)
    assert [m["task"]["id"] for m in training.metadata] != [m["task"]["id"] for m in bench.metadata]
