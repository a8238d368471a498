"""Held-out compositions: the test splits hold only prompts the training generator never produces."""

import json
from pathlib import Path

import pytest

from flowalign.errors import UserError
from flowalign.benchmarks import load_benchmark
from rewards.vvr import (
    EASY_COLOURS,
    EASY_SHAPES,
    HELDOUT_PAIRS,
    SPLIT_SEEDS,
    Constraint,
    generate_heldout_tasks,
    generate_tasks,
    is_heldout,
    load_split,
)
from rewards.vvr.heldout import canonical_relation, heldout_compositions

REPO = Path(__file__).resolve().parents[3]
#: (tasks, seeds) of the training generator checked per level; hard tasks are slower to draw
TRAINING_DRAWS = {"easy": (2000, (0, 1, 2, 7)), "medium": (2000, (0, 1, 2)), "hard": (600, (0, 1))}


@pytest.mark.parametrize("level", ["easy", "medium", "hard"])
def test_no_test_prompt_is_a_training_prompt(level):
    test_prompts = {t.prompt for t in load_split(level, "test")}
    n, seeds = TRAINING_DRAWS[level]
    for seed in seeds:
        training = generate_tasks(n, seed=seed, level=level)
        assert not any(is_heldout(t.constraints) for t in training)
        assert not test_prompts & {t.prompt for t in training}


@pytest.mark.parametrize("level", ["easy", "medium", "hard"])
def test_shipped_splits_are_disjoint_and_match_the_generator(level):
    test, validation = load_split(level, "test"), load_split(level, "validation")
    assert len(test) == len(validation) == 500
    assert all(is_heldout(t.constraints) for t in test)
    assert not any(is_heldout(t.constraints) for t in validation)
    assert not {t.prompt for t in test} & {t.prompt for t in validation}
    assert not {t.id for t in test} & {t.id for t in validation}
    # the files are what the generator draws with the documented seeds (a prefix keeps this fast)
    assert [t.to_dict() for t in test[:10]] == [t.to_dict() for t in
                                                generate_heldout_tasks(10, seed=SPLIT_SEEDS["test"][level], level=level)]
    assert [t.to_dict() for t in validation[:10]] == [t.to_dict() for t in
                                                      generate_tasks(10, seed=SPLIT_SEEDS["validation"][level], level=level)]
    lines = (REPO / "assets" / "vvr" / level / "test.jsonl").read_text().splitlines()
    assert json.loads(lines[0])["prompt"] == test[0].prompt


def test_easy_holds_out_a_diagonal_every_colour_and_shape_still_trains():
    assert len(HELDOUT_PAIRS) == len(EASY_COLOURS)
    training = {(t.objects[0].colour, t.objects[0].shape) for t in generate_tasks(600, seed=4, level="easy")}
    assert not training & HELDOUT_PAIRS
    assert {c for c, _ in training} == set(EASY_COLOURS) and {s for _, s in training} == set(EASY_SHAPES)
    assert len(training) == len(EASY_COLOURS) * len(EASY_SHAPES) - len(HELDOUT_PAIRS)
    assert {(t.objects[0].colour, t.objects[0].shape) for t in load_split("easy", "test")} == HELDOUT_PAIRS


def test_mirrored_relations_are_held_out_together():
    red_circle, blue_square = {"colour": "pink", "shape": "circle"}, {"colour": "cyan", "shape": "square"}
    left = Constraint("left_of", {"a": red_circle, "b": blue_square})
    right = Constraint("right_of", {"a": blue_square, "b": red_circle})
    assert canonical_relation("right_of", "square", "circle") == ("left_of", "circle", "square")
    assert is_heldout([left]) and is_heldout([right])
    assert not is_heldout([Constraint("left_of", {"a": blue_square, "b": red_circle})])
    assert heldout_compositions([Constraint("count_shape", {"shape": "circle", "n": 3})]) == ["exactly 3 circle"]
    assert not is_heldout([Constraint("count_shape", {"shape": "circle", "n": 1})])


def test_benchmark_split_argument():
    val = load_benchmark("vvr", "medium", n=3, split="validation")
    test = load_benchmark("vvr", "medium", n=3)
    assert (val.split, test.split) == ("validation", "test")
    assert val.prompts == [t.prompt for t in load_split("medium", "validation", 3)]
    fresh = load_benchmark("vvr", "easy", n=20, seed=5, split="test")
    assert fresh.prompts == [t.prompt for t in generate_heldout_tasks(20, seed=5, level="easy")]
    with pytest.raises(UserError, match="choose one of validation, test"):
        load_benchmark("vvr", "easy", split="dev")
