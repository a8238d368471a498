"""The sr benchmark: deterministic degradations of every kind and strength, splits with no scene in common,
and Kontext-style items (the LR image as the conditioning image, the HR scene as the target)."""

import random

import numpy as np
import pytest

from flowalign.benchmarks import load_benchmark, render_task, training_tasks
from flowalign.sampling.inputs import load_input_image
from rewards.sr import (
    HR_SIZE, STRENGTHS, Degradation, degrade, draw_degradation, generate_sr_tasks, load_split, lr_size, render_hr,
    render_lr, scene_key,
)


def _keys(tasks):
    return {scene_key(t.scene) for t in tasks}


def test_degradation_is_deterministic_from_its_seed_and_changes_with_it():
    task = load_split("hard", "test", n=1)[0]
    d = Degradation(3, blur=1.0, noise=0.05, jpeg=40, seed=7)
    a, b = np.asarray(degrade(render_hr(task), d)), np.asarray(degrade(render_hr(task), d))
    other = np.asarray(degrade(render_hr(task), Degradation(3, blur=1.0, noise=0.05, jpeg=40, seed=8)))
    assert a.shape == (lr_size(HR_SIZE, 3),) * 2 + (3,) and (a == b).all() and (a != other).any()


def test_each_kind_degrades_and_stronger_is_further_from_the_clean_downscale():
    hr = render_hr(load_split("medium", "test", n=1)[0])
    clean = np.asarray(degrade(hr, Degradation(2)), dtype=np.float32)

    def dist(**kind):
        return np.abs(np.asarray(degrade(hr, Degradation(2, **kind)), dtype=np.float32) - clean).mean()

    assert 0 < dist(blur=0.5) < dist(blur=2.0)
    assert 0 < dist(noise=0.01) < dist(noise=0.08)
    assert 0 < dist(jpeg=90) < dist(jpeg=10)


def test_levels_draw_every_kind_and_hard_downscales_more_than_easy():
    draws = {lv: [draw_degradation(random.Random(i), lv) for i in range(200)] for lv in STRENGTHS}
    for level, ds in draws.items():
        kinds = {k for d in ds for k in d.kinds}
        assert kinds == {"blur", "downscale", "noise", "jpeg"}, level
    assert {d.scale for d in draws["easy"]} == {2} and {d.scale for d in draws["hard"]} == {3, 4}
    mean_blur = {lv: np.mean([d.blur for d in ds if d.blur]) for lv, ds in draws.items()}
    assert mean_blur["easy"] < mean_blur["medium"] < mean_blur["hard"]


@pytest.mark.parametrize("level", ["easy", "hard"])
def test_train_validation_and_test_share_no_scene(level):
    train = generate_sr_tasks(300, seed=0, level=level)
    validation, test = load_split(level, "validation"), load_split(level, "test")
    assert len(_keys(validation)) == len(validation) and len(_keys(test)) == len(test)
    assert not _keys(train) & _keys(test) and not _keys(train) & _keys(validation)
    assert not _keys(validation) & _keys(test)
    assert [t.to_dict() for t in load_split(level, "test")] == [t.to_dict() for t in test]  # deterministic


def test_benchmark_items_are_kontext_style_lr_conditioning_and_hr_target():
    bench = load_benchmark("sr", "medium", n=3, split="test")
    assert bench.reward.name == "compass_fr" and len(set(bench.prompts)) == 1
    for meta in bench.metadata:
        lr = load_input_image(meta["image"])
        scale = meta["task"]["degradation"]["scale"]
        assert lr.shape == (3, lr_size(HR_SIZE, scale), lr_size(HR_SIZE, scale))
        assert (lr == load_input_image(render_lr(meta["task"]))).all()
        hr = render_task("sr", meta, HR_SIZE)  # the renderer reward-free trainers (sft) learn toward
        assert hr.shape == (3, HR_SIZE, HR_SIZE)
    train = training_tasks("sr", "medium", 4, seed=0)
    assert all(m.get("image") is not None for m in train.metadata)
    assert not {scene_key(m["task"]["scene"]) for m in train.metadata} & _keys(load_split("medium", "test"))
