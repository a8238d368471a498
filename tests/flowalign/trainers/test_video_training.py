"""GRPO on video: the shipped motion config trains the tiny Wan model on vvr_motion and writes, at every
evaluation, playable clips with posters, per-clip verdicts, and the video gallery."""

import json

import pytest
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


def build_trainer_config(cfg):
    from flowalign.trainers import trainer_config

    return trainer_config(cfg.trainer)[1]


def test_pref_grpo_trains_on_video_with_the_video_judge_and_the_adaptive_kl_weight(tmp_path):
    """Pref-GRPO's Wan recipe in small: the (tiny, random) UnifiedReward judging pairs of videos by their frames
    in flex mode beside a first-frame reward, both reading the videos back from 16 fps mp4 files as theirs, the
    KL weight moved by the controller within its bounds."""
    run = tmp_path / "run"
    judge = assets_dir() / "tiny-rewards" / "unified_reward"
    cfg = load_config(None, [
        f"run.output_dir={run}", f"model.path={assets_dir() / 'tiny-wan-motion'}", "model.finetune=lora",
        "model.lora.rank=4", "data.bench=vvr_motion", "data.level=[easy]", "data.n=20", "eval.bench=null",
        "run.progress=false", "run.tensorboard=false",
        f"rewards=[{{name: unified_reward, weight: 0.7, path: '{judge}', mode: flex_pairwise, frames: 3, "
        "dtype: float32, max_tokens: 16, video_mp4_fps: 16}, {name: brightness_video, weight: 0.3, frames: first, "
        "video_mp4_fps: 16}]",
        "trainer.name=pref_grpo", "trainer.max_steps=2", "trainer.prompts_per_step=1", "trainer.group_size=3",
        "trainer.batch_size=3", "trainer.num_steps=4", "trainer.beta=0.004", "trainer.kl_adaptive=true",
        "trainer.kl_target=0.0025", "trainer.kl_horizon=80", "trainer.kl_beta_min=0.004", "trainer.kl_beta_max=0.006",
    ])
    train(cfg)
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "train/kl_beta" in m]
    assert len(steps) == 2 and all(0.004 <= m["train/kl_beta"] <= 0.006 and m["train/kl"] >= 0 for m in steps)
    # each step's weight is the controller's from the step's logged mean KL (one process: what it averages)
    from flowalign.trainers.parts.adaptive_kl import next_kl_weight

    beta, average = cfg.trainer["beta"], None
    tcfg = build_trainer_config(cfg)
    for m in steps:
        beta, average = next_kl_weight(beta, average, m["train/kl"], tcfg)
        assert m["train/kl_beta"] == pytest.approx(beta, rel=1e-6)
    assert all(m["reward/unified_reward"] == 0.5 for m in steps)  # the tiny judge's reply names no winner: ties


@pytest.mark.parametrize("where, override", [
    ("rewards", "rewards=[{name: brightness, video_mp4_fps: 16}]"),
    ("eval.rewards", "eval.rewards=[{name: brightness, video_mp4_fps: 16}]"),
])
def test_an_image_model_refuses_a_reward_entry_that_writes_videos(where, override, tmp_path, tiny_sd3_dir, prompt_file):
    from flowalign.errors import UserError
    from flowalign.train import build_trainer

    from .conftest import small_config

    extra = [override] + (["eval.bench=vvr", "eval.n=2"] if where == "eval.rewards" else [])
    with pytest.raises(UserError, match=rf"{re.escape(where)}\[0\] \(brightness\): video_mp4_fps writes videos .* "
                                        "drop video_mp4_fps"):
        build_trainer(small_config(tmp_path / "run", tiny_sd3_dir, prompt_file, *extra))


def test_evaluate_refuses_a_reward_that_writes_videos_for_an_image_model(tmp_path, tiny_sd3_dir, capsys):
    from flowalign.cli.main import main

    code = main(["evaluate", "--model", str(tiny_sd3_dir), "--level", "easy", "--n", "2", "--steps", "2",
                 "--reward", "{name: brightness, video_mp4_fps: 16}", "--out", str(tmp_path / "eval")])
    assert code == 2 and "--reward[0] (brightness): video_mp4_fps writes videos" in capsys.readouterr().err
    assert not (tmp_path / "eval").exists()
