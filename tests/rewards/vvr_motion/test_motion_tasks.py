"""Motion task grammar and generation: levels, prompts, validation, determinism, committed splits."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from flowalign.benchmarks import load_benchmark
from rewards.vvr import EASY_COLOURS, EASY_SHAPES, VOCABULARIES
from rewards.vvr_motion import (
    CONSTRAINT_TYPES,
    NUM_FRAMES,
    SPLIT_SEEDS,
    MotionTask,
    generate_tasks,
    load_split,
    render,
    verify,
)

REPO = Path(__file__).resolve().parents[3]


def test_constraint_types():
    assert CONSTRAINT_TYPES == ("moves", "still", "appears", "grows", "shrinks", "toward", "away_from")


def test_easy_is_one_core_object_moving_on_an_axis():
    for t in generate_tasks(50, seed=3, level="easy"):
        (o,) = t.objects
        (c,) = t.constraints
        s = o.start
        assert s.colour in EASY_COLOURS and s.shape in EASY_SHAPES and s.size == o.end_size == "medium" and s.filled
        assert c.type == "moves" and t.num_frames == NUM_FRAMES == 9 and o.appear == 0
        dx, dy = o.end_x - s.x, o.end_y - s.y
        along, across = {"left": (-dx, dy), "right": (dx, dy), "up": (-dy, dx), "down": (dy, dx)}[c.args["direction"]]
        assert along >= 0.25 and across == 0
        words = {"left": "to the left", "right": "to the right", "up": "up", "down": "down"}[c.args["direction"]]
        assert t.prompt == f"{'an' if s.colour[0] in 'aeiou' else 'a'} {s.colour} {s.shape} moving {words}"


def test_medium_is_mover_and_still_object_or_moving_resize():
    vocab = VOCABULARIES["medium"]
    for t in generate_tasks(60, seed=3, level="medium"):
        types = [c.type for c in t.constraints]
        assert all(o.start.colour in vocab.colours and o.start.shape in vocab.shapes for o in t.objects)
        if len(t.objects) == 2:
            assert types == ["moves", "still"] and " while " in t.prompt and t.prompt.endswith("stays still")
        else:
            assert types[0] == "moves" and types[1] in ("grows", "shrinks") and len(types) == 2
            assert t.prompt.endswith(" and growing" if types[1] == "grows" else " and shrinking")


def test_hard_has_a_relative_constraint_and_names_every_object():
    tasks = generate_tasks(60, seed=3, level="hard")
    assert {len(t.objects) for t in tasks} == {2, 3}
    assert {c.type for t in tasks for c in t.constraints} == set(CONSTRAINT_TYPES)
    for t in tasks:
        assert len(t.constraints) >= 2
        assert sum(c.type in ("toward", "away_from") for c in t.constraints) == 1
        named = {tuple(sorted(r.items())) for c in t.constraints for r in c.refs}
        assert named == {tuple(sorted(o.ref.items())) for o in t.objects}
        assert len({o.start.colour for o in t.objects}) == len(t.objects)  # unique descriptors


def test_prompt_template_of_a_hard_task():
    d = {
        "objects": [
            {"id": 0, "shape": "square", "colour": "blue", "size": "medium", "x": 0.2, "y": 0.2, "end_x": 0.4, "end_y": 0.4},
            {"id": 1, "shape": "star", "colour": "green", "size": "medium", "x": 0.8, "y": 0.8},
            {"id": 2, "shape": "triangle", "colour": "yellow", "size": "small", "x": 0.8, "y": 0.2},
        ],
        "constraints": [
            {"type": "toward", "a": {"colour": "blue", "shape": "square"}, "b": {"colour": "green", "shape": "star"}},
            {"type": "still", "ref": {"colour": "yellow", "shape": "triangle"}},
            {"type": "shrinks", "ref": {"colour": "green", "shape": "star"}},
        ],
    }
    assert MotionTask.from_dict(d).prompt == (
        "a blue square moving toward the green star while a yellow triangle stays still and the green star shrinks"
    )


def test_round_trip_and_validation_messages():
    for t in generate_tasks(5, seed=1, level="hard"):
        assert MotionTask.from_dict(json.loads(json.dumps(t.to_dict()))) == t
    good = generate_tasks(1, seed=1, level="medium")[0].to_dict()
    bad_cases = {
        "constraints[0].type": {"constraints": [{"type": "spins", "ref": {"colour": "red"}}]},
        "moves, still, appears": {"constraints": [{"type": "spins", "ref": {"colour": "red"}}]},
        "constraints[0].direction": {"constraints": [{"type": "moves", "ref": {"colour": "red"}, "direction": "sideways"}]},
        "left, right, up, down": {"constraints": [{"type": "moves", "ref": {"colour": "red"}, "direction": "sideways"}]},
        "objects[0].end_size": {"objects": [{**good["objects"][0], "end_size": "huge"}]},
        "objects[0].appear": {"objects": [{**good["objects"][0], "appear": 1.5}]},
        "task.num_frames": {"num_frames": 1},
        "constraints[0].ref.colour": {"constraints": [{"type": "still", "ref": {"colour": "mauve"}}]},
    }
    for needle, change in bad_cases.items():
        with pytest.raises(ValueError, match=needle.replace("[", r"\[").replace("]", r"\]")):
            MotionTask.from_dict({**good, **change})


def test_same_seed_same_tasks_and_prefix_property():
    a = [t.to_dict() for t in generate_tasks(20, seed=5, level="hard")]
    assert a == [t.to_dict() for t in generate_tasks(20, seed=5, level="hard")]
    assert a[:7] == [t.to_dict() for t in generate_tasks(7, seed=5, level="hard")]
    assert a != [t.to_dict() for t in generate_tasks(20, seed=6, level="hard")]


_IN_PROCESS = """
import json
from rewards.vvr_motion import generate_tasks, render, verify
tasks = [t for l in ("easy", "medium", "hard") for t in generate_tasks(6, seed=9, level=l)]
v = verify(tasks[-1], render(tasks[-1], 64))
print(json.dumps({"tasks": [t.to_dict() for t in tasks], "verdict": [v.constraints, v.score, v.detected]}))
"""


def test_same_tasks_and_verdicts_in_a_fresh_process():
    out = subprocess.run([sys.executable, "-c", _IN_PROCESS], cwd=REPO, capture_output=True, text=True, check=True,
                         timeout=120)
    theirs = json.loads(out.stdout)
    tasks = [t for lvl in ("easy", "medium", "hard") for t in generate_tasks(6, seed=9, level=lvl)]
    v = verify(tasks[-1], render(tasks[-1], 64))
    assert theirs["tasks"] == [t.to_dict() for t in tasks]
    assert theirs["verdict"] == json.loads(json.dumps([v.constraints, v.score, v.detected]))


def test_committed_splits_match_the_generator_and_load_as_a_benchmark():
    assert SPLIT_SEEDS["validation"] == {"easy": 2101, "medium": 2102, "hard": 2103}
    for level, seed in SPLIT_SEEDS["validation"].items():
        lines = (REPO / "assets" / "vvr_motion" / level / "validation.jsonl").read_text().splitlines()
        assert len(lines) == 500
        # a longer list starts with the shorter one: checking a prefix keeps this fast
        assert [json.loads(x) for x in lines[:40]] == [t.to_dict() for t in generate_tasks(40, seed=seed, level=level)]
    assert all(t.id.startswith("motion-hard-2003-") for t in load_split("hard", n=3))
    bench = load_benchmark("vvr_motion", "medium", n=4)
    assert bench.name == "vvr_motion-medium" and len(bench.prompts) == len(bench.metadata) == 4
    assert bench.reward.name == "vvr_motion" and MotionTask.from_dict(bench.metadata[0]["task"]).prompt == bench.prompts[0]
    fresh = load_benchmark("vvr_motion", "easy", n=2, seed=7, split="validation")
    assert fresh.prompts == [t.prompt for t in generate_tasks(2, seed=7, level="easy")]
