"""scripts/passed_pairs.py: an evaluation's verified samples become pairs the SFT trainer reads."""

import json
from pathlib import Path

from PIL import Image

from flowalign.pairs import read_caption_pairs
from rewards.vvr import generate_tasks, render, verify
from tests.scripts import load_script


def _evaluation(folder: Path) -> list[bool]:
    """A folder as ``flowalign evaluate`` writes it: task 0 drawn right, task 1 drawn as another task's scene
    (a valid verdict that fails), task 2 a blank canvas (an invalid verdict)."""
    (folder / "samples").mkdir(parents=True)
    rows, passed = [], []
    tasks = generate_tasks(3, seed=3, level="easy")
    other = next(t for t in generate_tasks(50, seed=4, level="easy") if t.prompt.split()[1:] != tasks[1].prompt.split()[1:]
                 and t.prompt.split()[1] != tasks[1].prompt.split()[1])
    for i, task in enumerate(tasks):
        image = [render(task, size=64), render(other, size=64), Image.new("RGB", (64, 64), "white")][i]
        image.save(folder / "samples" / f"{i:05d}.png")
        v = verify(task, image)
        passed.append((v.valid, v.all_passed))
        rows.append({"index": i, "prompt": task.prompt, "valid": v.valid, "score": v.score,
                     "constraints": v.constraints, "all_passed": v.all_passed, "reason": "", "file": f"samples/{i:05d}.png"})
    (folder / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return passed


def test_only_passed_samples_become_pairs_the_sft_trainer_reads(tmp_path: Path):
    assert _evaluation(tmp_path / "eval") == [(True, True), (True, False), (False, False)]
    out = tmp_path / "pairs.jsonl"
    load_script("passed_pairs").main([str(tmp_path / "eval"), "--out", str(out)])
    pairs = read_caption_pairs(out)
    assert pairs.prompts == [generate_tasks(1, seed=3, level="easy")[0].prompt]
    assert Path(pairs.metadata[0]["image"]) == (tmp_path / "eval" / "samples" / "00000.png").resolve()


def test_min_score_keeps_valid_samples_at_or_above_it(tmp_path: Path):
    _evaluation(tmp_path / "eval")
    out = tmp_path / "pairs.jsonl"
    load_script("passed_pairs").main([str(tmp_path / "eval"), "--out", str(out), "--min-score", "0"])
    assert len(read_caption_pairs(out).prompts) == 2
