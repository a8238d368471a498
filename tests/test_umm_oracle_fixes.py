"""scripts/umm_oracle_fixes.py: the fix the verifier writes for a wrong one-object scene is the very instruction
the tiny unified model's revisions were taught for it (so the oracle speaks the model's language), and an error
that language cannot name gets no fix."""

import dataclasses
import random

from pipelines.pretrain.qwen_image_edit import easy_variant, render
from rewards.vvr import verify
from rewards.vvr.generate import generate_tasks
from tests.scripts import load_script

oracle_fix = load_script("umm_oracle_fixes").oracle_fix


def seen(task, scene) -> list[dict]:
    return verify(task, render(scene, 64)[:, 0].permute(1, 2, 0).numpy()).detected


def test_the_oracle_writes_the_taught_fix_for_a_recoloured_or_empty_scene():
    rng = random.Random(0)
    for i, task in enumerate(generate_tasks(6, seed=3, level="easy")):
        wrong, taught = easy_variant(task, i, rng)
        kind, fix = oracle_fix(task.to_dict(), seen(task, wrong))
        assert kind == ("nothing drawn" if i % 2 else "wrong colour")
        assert fix == taught


def test_a_wrong_shape_has_no_fix_in_the_models_language():
    task = generate_tasks(1, seed=5, level="easy")[0]
    (obj,) = task.objects
    other = "square" if obj.shape != "square" else "circle"
    wrong = dataclasses.replace(task, objects=(dataclasses.replace(obj, shape=other),))
    assert oracle_fix(task.to_dict(), seen(task, wrong)) == ("wrong shape", None)
