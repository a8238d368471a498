"""The registered ``vvr`` reward: protocol, shapes, validity mask, info."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import rewards
from flowalign.errors import UserError
from flowalign.protocols import Reward, RewardOutput
from rewards.vvr import Task, VVRReward, generate_tasks, render


def _batch(tasks, size=64):
    return torch.stack([torch.from_numpy(np.array(render(t, size))).permute(2, 0, 1).float() / 255 for t in tasks])


def test_registered_and_loadable():
    assert "vvr" in rewards.available()
    reward = rewards.load("vvr")
    assert isinstance(reward, VVRReward) and isinstance(reward, Reward)
    assert reward.name == "vvr" and reward.differentiable is False


def test_scores_valid_mask_and_info():
    tasks = generate_tasks(3, seed=2, level="hard") + generate_tasks(1, seed=2, level="easy")
    x = _batch(tasks)
    x[1] = 1.0  # blank
    x[2, :, :, :] = x[2].flip(-1)  # mirrored: positions change, so some relation may fail
    meta = [{"task": tasks[0]}, {"task": tasks[1].to_dict()}, {"task": tasks[2]}, {}]
    out = rewards.load("vvr")(x, [t.prompt for t in tasks], meta)
    assert isinstance(out, RewardOutput)
    assert set(out.components) == {"vvr"}
    assert out.components["vvr"].shape == (4,) and out.components["vvr"].dtype == torch.float32
    assert out.valid.dtype == torch.bool and out.valid.tolist() == [True, False, True, False]
    assert out.components["vvr"][0] == 1.0 and out.info[0]["all_passed"]
    assert [k for k, _ in out.info[0]["constraints"]] == [c.type for c in tasks[0].constraints]
    assert "blank" in out.info[1]["reason"] and out.components["vvr"][1] == 0.0
    assert "no 'task'" in out.info[3]["reason"]
    assert 0.0 <= out.components["vvr"][2] <= 1.0
    assert len(out.info) == 4


def test_gamma_and_nonfinite_samples():
    tasks = generate_tasks(2, seed=3, level="hard")
    x = _batch(tasks)
    x[1, 0, 0, 0] = float("nan")
    out = VVRReward(gamma=0.0)(x, ["", ""], [{"task": t} for t in tasks])
    assert out.valid.tolist() == [True, False] and "NaN" in out.info[1]["reason"]
    with pytest.raises(UserError):
        VVRReward(gamma=2.0)


def test_videos_are_refused():
    with pytest.raises(UserError, match="images"):
        VVRReward()(torch.rand(1, 2, 3, 64, 64), [""], [{}])


def test_partial_credit_ranks_right_objects_in_the_wrong_place_above_nothing():
    import numpy as np
    import torch

    from rewards.vvr import generate_tasks, render
    from rewards.vvr.reward import VVRReward

    task = next(t for t in generate_tasks(40, seed=3, level="medium")
                if t.constraints[0].type in {"left_of", "right_of", "above", "below"})
    good = torch.from_numpy(np.array(render(task, 64))).permute(2, 0, 1).float() / 255
    swapped = task.to_dict()  # same objects, positions exchanged: the relation fails
    a, b = swapped["objects"]
    a["x"], b["x"], a["y"], b["y"] = b["x"], a["x"], b["y"], a["y"]
    from rewards.vvr import Task

    wrong_place = torch.from_numpy(np.array(render(Task.from_dict(swapped), 64))).permute(2, 0, 1).float() / 255
    blank = torch.ones_like(good)
    meta = [{"task": task.to_dict()}] * 3
    plain = VVRReward()(torch.stack([good, wrong_place, blank]), [task.prompt] * 3, meta)
    dense = VVRReward(partial_credit=True)(torch.stack([good, wrong_place, blank]), [task.prompt] * 3, meta)
    assert plain.components["vvr"].tolist()[1:] == [0.0, 0.0]  # binary: no ranking below success
    s = dense.components["vvr"].tolist()
    assert s[0] == 1.0 and s[0] > s[1] > s[2] == 0.0
    assert [i["all_passed"] for i in dense.info] == [True, False, False]  # accuracy is the verifier's


def test_partial_credit_only_for_what_the_prompt_names():
    """"exactly two yellow objects" names a colour, not shapes: drawing the scene's hidden shapes earns
    nothing beyond drawing any yellow object; "exactly three objects" names nothing to credit."""
    from rewards.vvr import Task
    from rewards.vvr.reward import _named_objects_drawn

    def task(constraints):
        return Task.from_dict({"objects": [
            {"id": 0, "colour": "yellow", "shape": "star", "size": "medium", "x": 0.3, "y": 0.5, "filled": True},
            {"id": 1, "colour": "yellow", "shape": "circle", "size": "medium", "x": 0.7, "y": 0.5, "filled": True}],
            "constraints": constraints, "background": "white"})

    yellow_squares = [{"colour": "yellow", "shape": "square"}] * 2
    count = task([{"type": "count_colour", "colour": "yellow", "n": 2}])
    assert _named_objects_drawn(count, yellow_squares) == [True]  # the hidden star/circle do not matter
    assert _named_objects_drawn(count, [{"colour": "red", "shape": "star"}]) == [False]
    assert _named_objects_drawn(task([{"type": "total_count", "n": 2}]), yellow_squares) == []
    relation = task([{"type": "left_of", "a": {"colour": "yellow", "shape": "star"},
                      "b": {"colour": "yellow", "shape": "circle"}}])
    assert _named_objects_drawn(relation, [{"colour": "yellow", "shape": "star"}]) == [True, False]
    absent = task([{"type": "absent", "ref": {"colour": "yellow", "shape": "star"}}])
    assert _named_objects_drawn(absent, [{"colour": "yellow", "shape": "star"}]) == []


def test_info_lists_the_shapes_the_task_names():
    from rewards.vvr.reward import shapes_named

    task = Task.from_dict({"constraints": [
        {"type": "left_of", "a": {"colour": "red", "shape": "star"}, "b": {"colour": "blue", "shape": "circle"}},
        {"type": "count_shape", "shape": "hexagon", "n": 0}, {"type": "count_colour", "colour": "red", "n": 1}]})
    assert shapes_named(task) == ["circle", "hexagon", "star"]
    out = VVRReward()(torch.zeros(1, 3, 64, 64), [task.prompt], [{"task": task.to_dict()}])
    assert out.info[0]["shapes"] == ["circle", "hexagon", "star"]
