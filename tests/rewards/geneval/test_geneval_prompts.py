"""The GenEval-style prompt set: held-out compositions, shipped splits, the benchmark, GenEval files as prompts."""

import json

import pytest

from flowalign.benchmarks import load_benchmark, training_tasks
from flowalign.data import read_prompt_file
from flowalign.errors import UserError
from rewards.geneval.prompts import HELDOUT_COLOURS, HELDOUT_PAIRS, generate_tasks, heldout_compositions
from rewards.geneval.reward import check_metadata
from rewards.geneval.splits import draw_split, load_split
from rewards.geneval.vocabulary import CLASSES, COLOURS, TAGS


def test_training_draws_exclude_heldout_and_test_holds_only_heldout():
    train = generate_tasks(600, seed=3)
    assert {t["tag"] for t in train} == set(TAGS) and not any(heldout_compositions(t) for t in train)
    test = load_split("test")
    assert test and all(heldout_compositions(t) for t in test)
    assert not {t["prompt"] for t in test} & {t["prompt"] for t in load_split("validation")}


def test_heldout_pairs_ignore_order_and_every_word_still_trains():
    a, b = next(iter(HELDOUT_PAIRS))
    for first, second in ((a, b), (b, a)):
        task = {"tag": "two_object", "include": [{"class": first, "count": 1}, {"class": second, "count": 1}]}
        assert heldout_compositions(task)
    train = generate_tasks(3000, seed=1)
    named = {r["class"] for t in train for r in t["include"]}
    assert named == set(CLASSES)
    assert {r["color"] for t in train for r in t["include"] if "color" in r} == set(COLOURS)
    assert not {(r["class"], r.get("color")) for t in train for r in t["include"]} & HELDOUT_COLOURS


def test_shipped_splits_are_reproducible_and_valid():
    for split in ("validation", "test"):
        assert draw_split(split) == load_split(split)
        for i, task in enumerate(load_split(split)):
            check_metadata(task, set(CLASSES), f"{split}:{i}")


def test_benchmark_metadata_are_geneval_lines(monkeypatch, tmp_path):
    train = training_tasks("geneval", n=12, seed=0)
    assert len(train.prompts) == 12 and all("prompt" not in m and m["tag"] in TAGS for m in train.metadata)
    monkeypatch.delenv("FLOWALIGN_GENEVAL_PATH", raising=False)
    with pytest.raises(UserError, match=r"set its path to a download of facebook/mask2former.* with --reward-option "
                                        r"path=DIR or eval.reward_options.path \(or \$FLOWALIGN_GENEVAL_PATH\)"):
        load_benchmark("geneval", split="validation")
    monkeypatch.setenv("FLOWALIGN_GENEVAL_PATH", str(tmp_path))
    monkeypatch.setenv("FLOWALIGN_GENEVAL_CLIP_PATH", str(tmp_path))
    bench = load_benchmark("geneval", n=5, split="test")
    assert bench.prompts == [t["prompt"] for t in load_split("test", 5)] and bench.reward.name == "geneval"


def test_an_original_geneval_metadata_file_reads_unchanged(tmp_path):
    lines = [
        {"tag": "position", "include": [{"class": "bench", "count": 1},
                                        {"class": "dog", "count": 1, "position": ["right of", 0]}],
         "prompt": "a photo of a dog right of a bench"},
        {"tag": "counting", "include": [{"class": "clock", "count": 2}], "exclude": [{"class": "clock", "count": 3}],
         "prompt": "a photo of two clocks"},
    ]
    path = tmp_path / "evaluation_metadata.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    prompts = read_prompt_file(path)
    assert prompts.prompts == [line["prompt"] for line in lines]
    assert prompts.metadata == [{k: v for k, v in line.items() if k != "prompt"} for line in lines]
    for meta in prompts.metadata:
        check_metadata(meta, set(CLASSES), "line")


def test_the_benchmark_reward_takes_its_options_from_reward_options_before_the_environment(monkeypatch, tmp_path,
                                                                                          images):
    """``eval.reward_options`` / ``--reward-option`` reach the geneval reward through ``load_benchmark``: the
    tiny folders they name score the split's samples though the environment names nothing (or a wrong folder)."""
    from rewards.tiny_rewards import TINY_BUILDERS

    options = TINY_BUILDERS["geneval"](tmp_path / "weights")
    monkeypatch.setenv("FLOWALIGN_GENEVAL_PATH", str(tmp_path / "elsewhere"))
    monkeypatch.delenv("FLOWALIGN_GENEVAL_CLIP_PATH", raising=False)
    given = {k: str(v) for k, v in options.items()}
    bench = load_benchmark("geneval", n=2, split="test", reward_options={**given, "batch_size": 1})
    out = bench.reward(images(2), bench.prompts, bench.metadata)
    assert out.components["geneval"].shape == (2,) and bench.reward.options["path"] == given["path"]
    assert set(out.components["geneval"].tolist()) <= {0.0, 1.0}  # score: strict, GenEval's accuracy
    monkeypatch.setenv("FLOWALIGN_GENEVAL_CLIP_PATH", given["clip_path"])  # the fallback still works
    assert load_benchmark("geneval", n=1, split="test", reward_options={"path": given["path"]}).reward.options[
        "clip_path"] == given["clip_path"]
    with pytest.raises(UserError, match="benchmark 'vvr' takes no reward options \\(got path\\)"):
        load_benchmark("vvr", n=1, reward_options={"path": given["path"]})
