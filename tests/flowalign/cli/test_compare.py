"""``flowalign compare A B``: paired wins and losses, overall and per group of prompts."""

import json
from pathlib import Path

import pytest

from flowalign.cli.compare import compare, read_results, sign_test_p
from flowalign.cli.main import main


def eval_dir(folder: Path, passed: list[bool], prompts: list[str] | None = None,
             shapes: list[list[str]] | None = None) -> Path:
    """A folder as ``flowalign evaluate --out`` writes it (results only)."""
    folder.mkdir(parents=True)
    prompts = prompts or [f"task {i}" for i in range(len(passed))]
    shapes = shapes or [[] for _ in passed]
    rows = [{"index": i, "prompt": q, "score": float(p), "all_passed": p, "constraints": [["exists", p]], "shapes": s}
            for i, (p, q, s) in enumerate(zip(passed, prompts, shapes))]
    (folder / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def test_groups_prompts_by_the_shape_they_name(tmp_path, capsys):
    prompts = ["a red star", "a blue star", "a red circle", "exactly two squares"]
    shapes = [["star"], ["star"], ["circle"], ["square"]]
    base = eval_dir(tmp_path / "base", [True, True, False, True], prompts, shapes)
    tuned = eval_dir(tmp_path / "tuned", [True, False, True, True], prompts, shapes)
    assert main(["compare", str(base), str(tuned), "--by", "shape"]) == 0
    total, *groups = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert (total["wins"], total["losses"], total["ties"], total["n"]) == (1, 1, 2, 4)
    assert total["a_mean"] == 0.75 and total["b_mean"] == 0.75 and total["win_rate"] == 0.5
    by_shape = {g["shape"]: (g["n"], g["wins"], g["losses"]) for g in groups}
    assert by_shape == {"circle": (1, 1, 0), "square": (1, 0, 0), "star": (2, 0, 1)}


def test_sign_test_and_constraint_groups(tmp_path):
    base = read_results(eval_dir(tmp_path / "a", [False] * 10))
    tuned = read_results(eval_dir(tmp_path / "b", [True] * 9 + [False]))
    total, group = compare(base, tuned, on="passed", by="constraint")
    assert (total["wins"], total["losses"]) == (9, 0) and total["wins_over_decided"] == 1.0
    assert total["sign_test_p"] == pytest.approx(2 * 0.5 ** 9) == sign_test_p(9, 0)
    assert group["constraint"] == "exists" and group["n"] == 10
    assert sign_test_p(0, 0) == 1.0


def test_different_prompts_or_missing_results_are_one_line_errors(tmp_path, capsys):
    a = eval_dir(tmp_path / "a", [True], ["a red star"])
    b = eval_dir(tmp_path / "b", [True], ["a blue star"])
    assert main(["compare", str(a), str(b)]) == 2
    assert "different prompts" in capsys.readouterr().err
    assert main(["compare", str(a), str(tmp_path / "nothing")]) == 2
    err = capsys.readouterr().err
    assert "no results.jsonl" in err and len(err.strip().splitlines()) == 1


def scored_dir(folder: Path, values: dict[str, list[float | None]]) -> Path:
    """A folder as ``flowalign evaluate --prompts F --reward ...`` writes it: per-sample ``scores``."""
    folder.mkdir(parents=True)
    names = list(values)
    n = len(values[names[0]])
    rows = [{"index": i, "prompt": f"p{i}", "score": values[names[0]][i],
             "scores": {k: values[k][i] for k in names}} for i in range(n)]
    (folder / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def test_continuous_reward_gets_paired_differences_interval_and_wilcoxon(tmp_path, capsys):
    from scipy.stats import ttest_rel, wilcoxon

    a = [0.10, 0.40, 0.35, 0.80, 0.55, 0.20, None]
    b = [0.30, 0.45, 0.30, 0.95, 0.70, 0.20, 0.9]  # the last pair: A invalid, left out of the differences
    base = scored_dir(tmp_path / "a", {"brightness": [0.0] * 7, "pickscore": a})
    tuned = scored_dir(tmp_path / "b", {"brightness": [0.0] * 7, "pickscore": b})
    assert main(["compare", str(base), str(tuned), "--reward", "pickscore"]) == 0
    line = json.loads(capsys.readouterr().out)
    d = [y - x for x, y in zip(a[:6], b[:6])]
    assert line["reward"] == "pickscore" and line["n_paired"] == 6
    assert (line["wins"], line["losses"], line["ties"], line["unscored"]) == (4, 1, 1, 1)
    assert line["win_rate"] == pytest.approx(4.5 / 6)  # over the pairs both scored
    assert line["mean_diff"] == pytest.approx(sum(d) / 6)
    # the interval is the paired t-test's: its p-value is 0.05 exactly at the interval's bound
    assert ttest_rel([x + line["diff_ci95_low"] for x in a[:6]], b[:6]).pvalue == pytest.approx(0.05)
    assert line["wilcoxon_p"] == pytest.approx(wilcoxon([x for x in d if x != 0]).pvalue)
    assert main(["compare", str(base), str(tuned), "--reward", "hpsv3"]) == 2
    assert "has brightness, pickscore" in capsys.readouterr().err


def test_evaluations_with_no_valid_score_are_refused_not_called_ties(tmp_path, capsys):
    base = scored_dir(tmp_path / "a", {"pickscore": [None, None]})
    tuned = scored_dir(tmp_path / "b", {"pickscore": [None, 0.5]})
    assert main(["compare", str(base), str(tuned)]) == 2
    err = capsys.readouterr().err
    assert "no prompt has a valid score in both evaluations (A: 0 of 2 valid, B: 1 of 2)" in err
    assert len(err.strip().splitlines()) == 1
    # one pair scored: it decides, the other is unscored, never a tie
    tuned = scored_dir(tmp_path / "c", {"pickscore": [0.4, 0.5]})
    base = scored_dir(tmp_path / "d", {"pickscore": [None, 0.2]})
    assert main(["compare", str(base), str(tuned)]) == 0
    line = json.loads(capsys.readouterr().out)
    assert (line["wins"], line["ties"], line["losses"], line["unscored"], line["win_rate"]) == (1, 0, 0, 1, 1.0)
    assert line["a_mean"] == pytest.approx(0.2) and line["b_mean"] == pytest.approx(0.45)
