"""Held-out motion compositions: the test splits hold only prompts the training generator never produces."""

import pytest

from flowalign.benchmarks import load_benchmark
from rewards.vvr_motion import (
    HELDOUT_MOVES,
    SPLIT_SEEDS,
    MotionConstraint,
    generate_heldout_tasks,
    generate_tasks,
    is_heldout,
    load_split,
)

TRAINING_DRAWS = {"easy": (2000, (0, 1, 2, 7)), "medium": (2000, (0, 1, 2)), "hard": (400, (0, 1))}


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
    assert [t.to_dict() for t in test[:10]] == [
        t.to_dict() for t in generate_heldout_tasks(10, seed=SPLIT_SEEDS["test"][level], level=level)]
    assert [t.to_dict() for t in validation[:10]] == [
        t.to_dict() for t in generate_tasks(10, seed=SPLIT_SEEDS["validation"][level], level=level)]


def test_easy_holds_out_shape_direction_pairs():
    moves = {(t.constraints[0].refs[0]["shape"], t.constraints[0].args["direction"])
             for t in generate_tasks(400, seed=3, level="easy")}
    assert not moves & HELDOUT_MOVES and len(moves) == 16 - len(HELDOUT_MOVES)
    assert {(t.constraints[0].refs[0]["shape"], t.constraints[0].args["direction"])
            for t in load_split("easy", "test")} == HELDOUT_MOVES
    def star(direction):
        return MotionConstraint("moves", {"ref": {"colour": "red", "shape": "star"}, "direction": direction})

    assert ("star", "down") in HELDOUT_MOVES and is_heldout([star("down")]) and not is_heldout([star("left")])


def test_benchmark_split_argument():
    val = load_benchmark("vvr_motion", "easy", n=3, split="validation")
    assert val.split == "validation" and val.prompts == [t.prompt for t in load_split("easy", "validation", 3)]
    assert load_benchmark("vvr_motion", "easy", n=3).prompts == [t.prompt for t in load_split("easy", "test", 3)]
