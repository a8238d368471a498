"""scripts/win_rate.py: paired wins and losses, overall and per group of prompts."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _eval_dir(folder: Path, passed: list[bool]) -> Path:
    """An evaluation folder as ``flowalign evaluate`` writes it, reduced to its ``results.jsonl``."""
    folder.mkdir(parents=True)
    rows = [{"index": i, "prompt": f"task {i}", "score": float(p), "all_passed": p} for i, p in enumerate(passed)]
    (folder / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def test_win_rate_groups_prompts_by_the_shape_they_name(tmp_path):
    base = _eval_dir(tmp_path / "base", [True, True, False, True])
    trained = _eval_dir(tmp_path / "trained", [True, False, True, True])
    for folder in (base, trained):  # prompts that name shapes, as the easy split's do
        rows = [json.loads(line) for line in (folder / "results.jsonl").read_text().splitlines()]
        for row, prompt in zip(rows, ["a red star", "a blue star", "a red circle", "two squares"]):
            row["prompt"], row["constraints"] = prompt, [["exists", row["all_passed"]]]
        (folder / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "win_rate.py"), str(base), str(trained), "--by", "shape"],
                         capture_output=True, text=True, check=True)
    total, *groups = [json.loads(line) for line in out.stdout.splitlines()]
    assert (total["wins"], total["losses"], total["ties"]) == (1, 1, 2)
    by_shape = {g["shape"]: (g["n"], g["wins"], g["losses"]) for g in groups}
    assert by_shape == {"circle": (1, 1, 0), "square": (1, 0, 0), "star": (2, 0, 1)}
