"""scripts/measure.py: one headline row from several seeds' test evaluations, paired with the base's."""

import json

from tests.scripts import load_script


def write_eval(folder, passed):
    folder.mkdir(parents=True)
    rows = [{"prompt": f"p{i}", "all_passed": bool(x), "score": float(x)} for i, x in enumerate(passed)]
    (folder / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "metrics.json").write_text(json.dumps({"accuracy": sum(passed) / len(passed)}))
    return folder


def test_summary_pools_paired_wins_and_losses_over_seeds(tmp_path):
    measure = load_script("measure")
    base = write_eval(tmp_path / "base", [1, 0, 0, 1, 0])
    tuned = {0: write_eval(tmp_path / "s0", [1, 1, 0, 0, 0]),   # 1 win, 1 loss
             1: write_eval(tmp_path / "s1", [1, 1, 1, 1, 0])}   # 2 wins
    curves = {0: [(1, 0.1), (2, 0.2)], 1: [(1, 0.3), (2, 0.5), (3, 0.7)]}
    s = measure.summarise(base, tuned, curves)
    assert (s["base"], s["n"], s["wins"], s["losses"]) == (0.4, 5, 3, 1)
    assert (s["min"], s["max"]) == (0.4, 0.8) and abs(s["mean"] - 0.6) < 1e-12
    assert s["seeds"][1]["steps"] == 3 and abs(s["seeds"][1]["reward_last5"] - 0.5) < 1e-12
    assert abs(s["sign_test_p"] - 0.625) < 1e-9  # two-sided binomial, 3 of 4
    # a trainer that logs no training reward (AR-CoPO on replayed groups alone) counts its checkpoint's steps
    counted = measure.summarise(base, tuned, {0: [], 1: []}, {0: 200, 1: 120})
    assert [counted["seeds"][k]["steps"] for k in (0, 1)] == [200, 120]


def test_a_checkpoint_folder_names_its_step(tmp_path):
    from flowalign.checkpoint import checkpoint_step, step_dir_name

    assert checkpoint_step(tmp_path / step_dir_name(200)) == 200


def test_reward_curve_reads_the_training_reward_of_each_step(tmp_path):
    measure = load_script("measure")
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [
        {"step": 1, "reward/total": 0.2}, {"step": 1, "eval/accuracy": 0.5}, {"step": 2, "reward/total": 0.4}]))
    assert measure.reward_curve(tmp_path) == [(1, 0.2), (2, 0.4)]


def test_overrides_may_come_before_or_after_the_one_value_flags():
    parse = load_script("measure").parse
    before = parse(["c.yaml", "a=1", "b=[{x: 1}]", "--seeds", "0", "1", "--base", "B", "--out", "O"])
    after = parse(["c.yaml", "a=1", "--seeds", "0", "1", "--base", "B", "b=[{x: 1}]", "--out", "O"])
    assert before.overrides == after.overrides == ["a=1", "b=[{x: 1}]"]
    assert (after.seeds, after.base, after.out) == ([0, 1], "B", "O")
