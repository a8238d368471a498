"""GRPO on video: the shipped motion config trains the tiny Wan model on vvr_motion and writes, at every
evaluation, playable clips with posters, per-clip verdicts, and the video gallery."""

import json
import re
from pathlib import Path

from flowalign.config import load_config
from flowalign.paths import assets_dir
from flowalign.train import train

REPO = Path(__file__).resolve().parents[3]


def test_flash_grpo_motion_config_writes_video_evals_and_gallery_at_every_evaluation(tmp_path):
    run = tmp_path / "run"
    cfg = load_config(REPO / "configs" / "tiny" / "flash_grpo_motion.yaml", [
        f"run.output_dir={run}", f"model.path={assets_dir() / 'tiny-wan-motion'}", "run.progress=false",
        "run.tensorboard=false", "trainer.max_steps=2", "trainer.max_minutes=null", "trainer.prompts_per_step=1",
        "trainer.group_size=2", "trainer.batch_size=2", "trainer.num_steps=4", "eval.every=1", "eval.n=2",
        "eval.num_steps=4",
    ])
    train(cfg)
    steps = sorted(p.name for p in (run / "evals").iterdir())
    assert steps == ["step-000000", "step-000001", "step-000002"]
    for step in steps:
        folder = run / "evals" / step
        rows = [json.loads(line) for line in (folder / "results.jsonl").read_text().splitlines()]
        assert len(rows) == 2 and json.loads((folder / "metrics.json").read_text())["bench"] == "vvr_motion-easy"
        for row in rows:
            # a per-clip verdict: the constraint, its pass/fail, and the named object's track over 9 frames
            assert [c for c, _ in row["constraints"]] == ["moves"] and len(row["tracks"][0]["found"]) == 9
            clip = folder / row["file"]
            assert clip.suffix in (".mp4", ".gif") and clip.stat().st_size > 0
            assert clip.with_name(clip.stem + ".poster.png").is_file()
    page = (run / "gallery" / "index.html").read_text()
    # one column per evaluation, a video per cell, each with its poster
    assert len(re.findall(r"<video[^>]*poster=\"[^\"]+\.poster\.png\"", page)) == 3 * 2
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if "eval/accuracy" in m] == [0, 1, 2]
    assert all("reward/vvr_motion" in m for m in metrics if "reward/total" in m)
