"""scripts/compare_methods.py: minutes from the run's log, paired wins/losses against the base."""

import json
import subprocess
import sys
from pathlib import Path

from tests.scripts import load_script

ROOT = Path(__file__).resolve().parents[1]


def _eval_dir(folder: Path, passed: list[bool]) -> Path:
    folder.mkdir(parents=True)
    rows = [{"index": i, "prompt": f"task {i}", "score": float(p), "all_passed": p} for i, p in enumerate(passed)]
    (folder / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def test_minutes_are_read_at_the_evaluated_step(tmp_path):
    run = tmp_path / "run"
    folder = _eval_dir(run / "evals" / "step-000002", [True])
    records = [{"step": 1, "time/train_minutes": 1.5}, {"step": 2, "time/train_minutes": 3.0},
               {"step": 2, "eval/accuracy": 1.0}, {"step": 3, "time/train_minutes": 4.5}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert load_script("compare_methods").train_minutes(folder) == 3.0


def test_table_counts_paired_wins_and_losses(tmp_path):
    base = _eval_dir(tmp_path / "base", [True, True, False, False, False])
    run = tmp_path / "run"
    trained = _eval_dir(run / "evals" / "step-000004", [True, False, True, True, False])
    (run / "metrics.jsonl").write_text(json.dumps({"step": 4, "time/train_minutes": 2.0}) + "\n")
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "compare_methods.py"), "--base", str(base),
                          "--png", str(tmp_path / "plot.png"), f"X={trained}"], capture_output=True, text=True, check=True)
    assert "| X | 2.0 | 60.0 % | 2 / 1 |" in out.stdout and "| base | 0 | 40.0 % |" in out.stdout
    assert (tmp_path / "plot.png").stat().st_size > 0


def test_minutes_given_after_at_and_a_repeated_name_is_one_curve(tmp_path):
    base = _eval_dir(tmp_path / "base", [False, False, False, False])
    early = _eval_dir(tmp_path / "early", [True, False, False, False])  # a checkpoint evaluated apart
    run = tmp_path / "run"
    late = _eval_dir(run / "evals" / "step-000009", [True, True, True, False])
    (run / "metrics.jsonl").write_text(json.dumps({"step": 9, "time/train_minutes": 8.0}) + "\n")
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "compare_methods.py"), "--base", str(base),
                          "--png", str(tmp_path / "plot.png"), f"A={early}@2.5", f"A={late}"],
                         capture_output=True, text=True, check=True)
    assert "| A | 2.5 | 25.0 % | 1 / 0 |" in out.stdout and "| A | 8.0 | 75.0 % | 3 / 0 |" in out.stdout
    assert (tmp_path / "plot.png").stat().st_size > 0


def test_plot_draws_every_method_once_with_its_budgets_joined():
    import numpy as np

    plot = load_script("compare_methods").plot
    base = np.array([True, False, False, False])
    rows = [("A", 2.5, 0.25, 1, 0, 1.0), ("B", 4.0, 0.5, 1, 0, 1.0), ("A", 8.0, 0.75, 2, 0, 0.5)]
    lines = {ln.get_gid(): ln for ln in plot(rows, base, "t").axes[0].get_lines() if ln.get_gid()}
    assert sorted(lines) == ["A", "B"]
    assert list(lines["A"].get_xdata()) == [2.5, 8.0] and list(lines["A"].get_ydata()) == [25.0, 75.0]
    assert lines["A"].get_color() != lines["B"].get_color()
    many = [(f"M{i}", float(i + 1), 0.5, 1, 0, 1.0) for i in range(23)]  # more methods than colours
    drawn = [ln for ln in plot(many, base, "t").axes[0].get_lines() if ln.get_gid()]
    assert len(drawn) == 23
    assert len({tuple(ln.get_color()) for ln in drawn[:20]}) == 20
