"""flowalign plan counts the frozen reward models each rank holds (``frozen reward models``): the rewards', the
held-out panel's, the evaluation benchmark's and a trainer's frozen encoders, each as it states its size; a
reward that cannot say is listed as not counted, never counted as 0."""

from __future__ import annotations

import pytest
import torch

import rewards
from flowalign.cli.main import main
from flowalign.config import load_config
from flowalign.paths import REPO_ROOT
from flowalign.plan import GB, plan_text, predicted_rows, settings
from flowalign.plan_rewards import frozen_models
from rewards.image_encoders import DINOv3

TINY_RECIPE = REPO_ROOT / "configs" / "tiny" / "flow_grpo_vvr.yaml"
TINY_MODEL = REPO_ROOT / "assets" / "tiny-sd3-vvr"
TINY = REPO_ROOT / "assets" / "tiny-rewards"
ROW = "frozen reward models"
#: HPSv3 as the flux recipe names it: placeholders, so the plan sizes its published Qwen2-VL-7B base
HPSV3 = "{name: hpsv3, path: /path/to/HPSv3, base: /path/to/Qwen2-VL-7B-Instruct, dtype: bf16}"
#: a small run of the tiny model, so each plan takes a second
SMALL = ["trainer.prompts_per_step=1", "trainer.group_size=2", "trainer.batch_size=2", "trainer.num_steps=2"]


def tiny(*overrides: str):
    return load_config(TINY_RECIPE, [*SMALL, *overrides])


def plain_sharpness(samples, prompts, metadata):
    return samples.mean((1, 2, 3))


def test_the_row_is_what_each_reward_states_eval_panel_included():
    options = {"path": str(TINY / "hpsv3"), "dtype": "float32"}
    cfg = tiny("rewards=[{name: hpsv3, path: %s, dtype: float32}, {name: vvr}]" % options["path"],
               "eval.rewards=[{name: imagereward, path: %s}]" % (TINY / "imagereward"))
    one = rewards.planned_bytes("hpsv3", options)
    panel = rewards.planned_bytes("imagereward", {"path": str(TINY / "imagereward")})
    frozen = frozen_models(cfg)
    assert frozen.counted == {"hpsv3": one, "vvr": 0, "eval.rewards imagereward": panel, "eval.bench vvr": 0}
    assert not frozen.not_counted
    assert predicted_rows(cfg, TINY_MODEL)[ROW] == one + panel > 0


def test_a_7b_vlm_reward_turns_a_run_that_fits_into_one_that_does_not(capsys):
    """What the plan missed before: HPSv3's Qwen2-VL-7B is 16.6 GB in bf16 on every rank."""
    without = sum(predicted_rows(tiny(), TINY_MODEL).values())
    cfg = tiny(f"rewards=[{HPSV3}]")
    rows = predicted_rows(cfg, TINY_MODEL)
    assert 16.5 * GB < rows[ROW] < 16.7 * GB
    assert sum(rows.values()) - without == pytest.approx(rows[ROW])
    budget = (without + 5 * GB) / GB
    assert "ddp: fits" in plan_text(tiny(), TINY_MODEL, 1, budget)
    text = plan_text(cfg, TINY_MODEL, 1, budget)
    assert "ddp: does not fit" in text and "frozen reward models per rank: hpsv3 16.60 GB" in text
    assert [line for line in text.splitlines() if line.startswith(f"  {ROW} ")] == [f"  {ROW:<36}{'16.6 GB':>12}"]
    # through the command
    assert main(["plan", str(TINY_RECIPE), *SMALL, f"rewards=[{HPSV3}]", "--gpus", "2"]) == 0
    out = capsys.readouterr().out
    assert f"  {ROW:<36}{'16.6 GB':>12}{'16.6 GB':>12}" in out  # whole on every rank, under fsdp too


def test_fsdp_does_not_shard_the_reward_models_and_device_cpu_keeps_them_off():
    cfg = tiny(f"rewards=[{HPSV3}]")
    assert settings(cfg, "fsdp", 4).frozen_rewards == settings(cfg, "ddp", 1).frozen_rewards > 16 * GB
    on_cpu = tiny("rewards=[{name: hpsv3, path: /path/to/HPSv3, device: cpu}, "
                  "{name: unified_reward, url: 'http://127.0.0.1:8080/v1'}]")
    assert predicted_rows(on_cpu, TINY_MODEL)[ROW] == 0
    assert frozen_models(on_cpu).counted == {"hpsv3": 0, "unified_reward": 0, "eval.bench vvr": 0}


def test_a_reward_that_cannot_say_is_listed_as_not_counted():
    spec = f"{__name__}:plain_sharpness"
    cfg = tiny(f"rewards=[{{name: '{spec}'}}, {{name: clip_score, path: /nowhere/clip}}, {HPSV3}]")
    frozen = frozen_models(cfg)
    assert set(frozen.not_counted) == {spec, "clip_score"} and set(frozen.counted) == {"hpsv3", "eval.bench vvr"}
    text = plan_text(cfg, TINY_MODEL, 1, 80)
    assert f"  not counted: {spec} (it does not state its size: give its class a planned_bytes(options) classmethod)" in text
    assert "  not counted: clip_score (path=/nowhere/clip does not exist, and no published architecture stands in for it)" in text
    assert predicted_rows(cfg, TINY_MODEL)[ROW] == frozen.counted["hpsv3"]  # the others not as 0 in disguise: absent


def test_one_reward_named_twice_is_two_models():
    cfg = tiny(f"rewards=[{HPSV3}, {HPSV3}]", "eval.rewards=[{name: hpsv3, label: judge, path: /path/to/HPSv3}]")
    counted = frozen_models(cfg).counted
    assert counted["hpsv3"] == counted["hpsv3 #2"] == counted["eval.rewards judge"] > 16 * GB


def test_gardos_diversity_encoder_is_counted_where_it_reads_one():
    gardo = REPO_ROOT / "configs" / "tiny" / "gardo_vvr.yaml"
    path = "/path/to/dinov3-vitl16-pretrain-lvd1689m"
    cfg = load_config(gardo, ["trainer.diversity_features=image_encoder",
                              f"trainer.diversity_encoder={{name: dinov3, path: {path}, dtype: bf16}}"])
    counted = frozen_models(cfg).counted
    assert counted["trainer.diversity_encoder dinov3"] == DINOv3.planned_bytes(path, dtype=torch.bfloat16) > 0.6 * GB
    assert not any(k.startswith("trainer.") for k in frozen_models(load_config(gardo, [])).counted)  # the latents
    other = load_config(gardo, ["trainer.diversity_features=image_encoder",
                                "trainer.diversity_encoder={name: dinov2, path: /nowhere/dinov2-base}"])
    assert frozen_models(other).not_counted == {"trainer.diversity_encoder dinov2": "path=/nowhere/dinov2-base does "
                                                "not exist, and no published architecture stands in for it"}


def test_the_evaluation_benchmarks_reward_counts_unless_a_prompt_file_replaces_it():
    detector, clip = TINY / "geneval" / "detector", TINY / "geneval" / "clip"
    cfg = tiny("eval.bench=geneval", f"eval.reward_options={{path: {detector}, clip_path: {clip}}}")
    expected = rewards.planned_bytes("geneval", {"path": str(detector), "clip_path": str(clip)})
    assert frozen_models(cfg).counted["eval.bench geneval"] == expected > 0
    cfg = tiny("eval.bench=geneval", "eval.prompts=some_prompts.txt", "eval.rewards=[{name: vvr}]")
    assert "eval.bench geneval" not in frozen_models(cfg).counted
