"""Each model reward's tiny config (``configs/tiny/flow_grpo_<reward>.yaml``) trains 2 steps with the weights
folder ``flowalign tiny-reward <reward>`` writes where the config's comment says (where it ships), its reward
entries as written: the reward is loaded, scores every sample validly and is logged."""

from __future__ import annotations

import json
import math
import os

import pytest

from flowalign.cli.main import main
from flowalign.config import load_config
from flowalign.paths import REPO_ROOT
from rewards.tiny_rewards import TINY_BUILDERS

CONFIGS = sorted(p for p in (REPO_ROOT / "configs" / "tiny").glob("flow_grpo_*.yaml")
                 if p.stem.removeprefix("flow_grpo_") in TINY_BUILDERS and p.stem != "flow_grpo_ocr")


def test_the_new_model_rewards_have_tiny_configs():
    # ocr's tiny config runs the rapidocr engine, which needs no tiny folder (tests/rewards/test_ocr.py trains
    # it); image_similarity scores edits against a source image, which the tiny text-to-image model has none
    # of; the CLIP rewards predate these
    have = {p.stem.removeprefix("flow_grpo_") for p in CONFIGS}
    assert have == set(TINY_BUILDERS) - {"ocr", "image_similarity", "pickscore", "hps", "clip_score", "aesthetic"}


@pytest.mark.slow
@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.stem)
def test_tiny_config_trains_two_steps_on_its_tiny_reward_folder(config, tmp_path, monkeypatch, capsys):
    name = config.stem.removeprefix("flow_grpo_")
    # the config's relative paths: assets/ of the repository, but assets/tiny-rewards/ written here by the
    # command the config's comment gives (the shipped folders are that command's output)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "assets").mkdir()
    for child in (REPO_ROOT / "assets").iterdir():
        if child.name != "tiny-rewards":
            os.symlink(child, tmp_path / "assets" / child.name)
    assert f"flowalign tiny-reward {name} --out assets/tiny-rewards/{name}" in config.read_text()
    assert main(["tiny-reward", name, "--out", f"assets/tiny-rewards/{name}"]) == 0
    cfg = load_config(config)
    assert [r.name for r in cfg.rewards] == [name]
    video = "wan" in cfg.model.path
    run = tmp_path / "run"
    code = main(["train", str(config), f"run.output_dir={run}", "run.progress=false", "run.tensorboard=false",
                 "trainer.max_steps=2", "trainer.prompts_per_step=1", "trainer.group_size=2", "trainer.batch_size=2",
                 "trainer.num_steps=2", "eval.every=2", "eval.at_start=false", "eval.n=2", "eval.num_steps=2",
                 *(["trainer.updates_per_epoch=1"] if not video else [])])
    err = capsys.readouterr().err
    assert code == 0 and "Traceback" not in err, err[-3000:]
    logs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in logs if f"reward/{name}" in row]
    assert [row["step"] for row in steps] == [1, 2]
    assert all(math.isfinite(row[f"reward/{name}"]) and row[f"reward/{name}_invalid_fraction"] == 0 for row in steps)
    evals = [row for row in logs if "eval/mean_score" in row or f"eval/{name}" in row]
    assert evals, f"no evaluation logged: {logs[-1]}"
