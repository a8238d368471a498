"""scripts/gpu_check.py: its --smoke path (tiny recipes in their own processes, the planner against a measured
run) runs on the CPU, and the per-step memory / throughput metrics reach metrics.jsonl."""

import json
import math
from pathlib import Path

import pytest
import torch

from flowalign import step_metrics
from flowalign.trainers.rollouts import StepBatch
from tests.scripts import load_script

check = load_script("gpu_check")
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """One --smoke run shared by the tests below: (return code, its JSON, its scratch folder)."""
    tmp = tmp_path_factory.mktemp("gpu-check")
    out, work = tmp / "check.json", tmp / "work"
    rc = check.main(["--smoke", "--device", "cpu", "--out", str(out), "--workdir", str(work)])
    return rc, json.loads(out.read_text()), work


@pytest.mark.slow
def test_smoke_trains_each_recipe_in_its_own_process_with_an_update(smoke):
    rc, results, _ = smoke
    rows = {r["recipe"]: r for r in results["recipes"]}
    # DGPO's recipe pins its former old policy and step draw: its defaults run as a row of their own
    assert rc == 0 and set(rows) == {*check.SMOKE_RECIPES, "dgpo_vvr" + check.DEFAULTS}, results
    for row in rows.values():
        assert row["status"] == "ok", row
        assert row["weights_device"] == "cpu" and row["steps"] == 1
        assert math.isfinite(row["loss"]) and row["grad_norm"] > 0  # the update ran, with a gradient
    assert results[check.MARK] == 1 and results["versions"]["torch"] == torch.__version__


@pytest.mark.slow
def test_smoke_compares_the_plan_with_and_without_checkpointing(smoke):
    _, results, _ = smoke
    plan = {r["gradient_checkpointing"]: r for r in results["plan"]}
    assert set(plan) == {True, False} and all(r["status"] == "ok" for r in plan.values()), results["plan"]
    # checkpointing keeps only the blocks' inputs: the override reached the planner
    assert 0 < plan[True]["predicted_activations_gib"] < plan[False]["predicted_activations_gib"]
    assert all(r["measured_gib"] is None for r in plan.values())  # no CUDA allocator to read on a CPU
    assert all(r["predicted_reward_models_gib"] == 0 for r in plan.values())  # vvr and JPEG size: programs
    assert "side_by_side" not in results  # no --reference-src
    table = check.table(results)
    assert table.count("| recipe |") == 3 and table.count("| plan |") == 2  # dgpo_vvr twice: as pinned, defaults


@pytest.mark.slow
def test_a_tiny_step_logs_its_throughput(smoke):
    _, _, work = smoke
    rows = [json.loads(line) for line in (work / "recipes" / "flow_grpo_vvr" / "run" / "metrics.jsonl")
            .read_text().splitlines() if '"time/step"' in line]
    assert len(rows) == 1
    # 1 prompt x 2 samples (the smoke size) over the step's seconds
    assert rows[0]["perf/samples_per_s"] == pytest.approx(2 / rows[0]["time/step"], rel=1e-6)
    assert not any(k.startswith("memory/") for k in rows[0])  # CPU: no allocator peaks


def test_step_metrics_count_the_group_batch():
    batch = StepBatch(chunks=[], groups=torch.tensor([0, 0, 1, 1, 2, 2]))
    assert step_metrics.generated_samples(batch) == 6
    assert step_metrics.generated_samples(object()) is None
    assert step_metrics.step_logs("cpu", 3.0, 6) == {"perf/samples_per_s": 2.0}
    assert step_metrics.step_logs("cpu", 3.0, None) == {}


def test_a_recipe_pinning_a_former_form_runs_again_with_its_trainers_defaults():
    from flowalign.config import load_config
    from flowalign.trainers import get_trainer

    recipe = check.TINY / "self_opd_vvr.yaml"
    extra = check.authors_defaults(recipe)
    assert sorted(extra) == ["trainer.drop_flat=true", "trainer.kept_multiple=16", "trainer.trunk_noise_level=0.7",
                             "trainer.trunks=16"]
    defaults = get_trainer("self_opd").Config.model_fields
    tcfg = load_config(recipe, extra).trainer
    assert all(tcfg[k] == defaults[k].default for k in ("trunks", "trunk_noise_level", "drop_flat", "kept_multiple"))
    assert check.authors_defaults(check.TINY / "flow_grpo_vvr.yaml") == []  # pins nothing: one row


def test_every_recipe_gets_a_varying_reward_beside_its_own():
    image = json.loads(check.varying_rewards(REPO / "configs/tiny/dgpo_vvr.yaml").removeprefix("rewards="))
    video = json.loads(check.varying_rewards(REPO / "configs/tiny/flow_grpo_motion.yaml").removeprefix("rewards="))
    assert [r["name"] for r in image] == ["vvr", "jpeg_compressibility"] and image[0]["partial_credit"] is True
    assert [r["name"] for r in video] == ["vvr_motion", "jpeg_compressibility_video"]


def test_a_trainer_that_reads_a_score_in_unit_range_gets_one(tmp_path, monkeypatch):
    """UMM-Reflection's shaped credit refuses a reward outside [0, 1]: its recipe's rewards are scaled to 0.9 and
    the varying term is brightness (in [0, 1]) at 0.1, and the trainer's credit accepts what they score."""
    from flowalign.config import load_config
    from flowalign.train import build_trainer

    recipe = REPO / "configs/tiny/umm_reflection_vvr.yaml"
    mixed = json.loads(check.varying_rewards(recipe).removeprefix("rewards="))
    assert [(r["name"], r["weight"]) for r in mixed] == [("vvr", 0.9), ("brightness", 0.1)]
    assert mixed[0]["partial_credit"] is True
    monkeypatch.chdir(REPO)
    cfg = load_config(recipe, check.recipe_overrides(recipe, tmp_path / "run", 1, smoke=True))
    trainer = build_trainer(cfg)
    batch = trainer.collect(0)  # the shaped credit checks every score it reads here
    assert batch is not None


def test_kvpos_authors_row_is_scored_by_a_reward_that_scores_one_chunk(tmp_path):
    """KVPO's authors' forms add a local signal on the routed chunk alone, which the tiny motion verifier calls
    invalid: its ``+defaults`` row is scored by the video's JPEG size, which the last ``rewards=`` sets."""
    recipe = REPO / "configs/tiny/kvpo_motion.yaml"
    rows = check.recipe_overrides(recipe, tmp_path / "run", 1, smoke=True, defaults=True)
    assert "trainer.local_weight=1.0" in rows
    rewards = [o for o in rows if o.startswith("rewards=")]
    assert json.loads(rewards[-1].removeprefix("rewards=")) == [{"name": "jpeg_compressibility_video"}]
    plain = [o for o in check.recipe_overrides(recipe, tmp_path / "run", 1, smoke=True) if o.startswith("rewards=")]
    assert "vvr_motion" in plain[-1]  # the recipe's own row keeps its verifier


def test_flops_of_a_row_are_counted_on_the_meta_device():
    small = check.row_flops(REPO / "assets/tiny-sd3-vvr", 64, 48)
    large = check.row_flops(REPO / "assets/tiny-sd3-vvr", 128, 48)
    assert small is not None and small > 0
    assert large > small  # four times the image tokens, the same text tokens


def test_a_file_that_is_not_an_earlier_check_is_not_overwritten(tmp_path, capsys):
    mine = tmp_path / "notes.json"
    mine.write_text('{"mine": true}\n')
    assert check.main(["--smoke", "--out", str(mine), "--parts", "recipes"]) == 2
    assert mine.read_text() == '{"mine": true}\n'
    assert "is not an earlier gpu_check result" in capsys.readouterr().err


@pytest.mark.slow
def test_smoke_levers_time_each_option_against_the_defaults_and_profile_them(tmp_path):
    """``--parts levers``: the defaults profiled and timed, then each option a CPU runs switched on in the same
    process; each row is an iteration that ran (rows through the transformer counted), the defaults' ratio is
    1 and the profile names the operators with their share of the iteration."""
    out = tmp_path / "levers.json"
    rc = check.main(["--smoke", "--device", "cpu", "--parts", "levers", "--repeats", "1", "--out", str(out),
                     "--workdir", str(tmp_path / "w")])
    results = json.loads(out.read_text())
    rows = {r["lever"]: r for r in results["levers"]["rows"]}
    assert rc == 0 and list(rows) == ["defaults", "lora.compute_dtype=model", "optimizer_kernel=fused"], results["levers"]
    assert rows["defaults"]["speed_vs_defaults"] == 1.0
    for row in rows.values():
        assert row["status"] == "ok" and row["iteration_s"] > 0 and row["rows"] > 0
        assert row["iteration_s"] >= row["rollout_s"] and row["rows"] == rows["defaults"]["rows"]  # the same work
    profile = results["levers"]["profile"]
    assert profile and all(p["op"] and p["calls"] > 0 for p in profile)
    assert 0 < sum(p["share"] for p in profile) <= 1.0001 and profile[0]["ms"] >= profile[-1]["ms"]
    assert check.table(results).count("| levers |") == 3 and "recipes" not in results


def test_a_lever_switched_on_a_built_trainer_does_what_its_option_does(tiny_sd3_dir):
    """The levers part switches options on a built trainer: ``lora.compute_dtype=model`` there is what the
    config option gives at load time (on a bf16 model), and it switches back."""
    import pipelines
    from pipelines.lora import InputDtypeLinear, compute_in_input_dtype

    class Built:  # the trainer's one attribute the levers read
        policy = pipelines.load(tiny_sd3_dir, dtype="bf16", lora={"rank": 4, "alpha": 8})

    at_load = pipelines.load(tiny_sd3_dir, dtype="bf16", lora={"rank": 4, "alpha": 8, "compute_dtype": "model"})
    factors = lambda p: [type(m) for n, m in p.transformer.named_modules() if n.endswith(("lora_A.default", "lora_B.default"))]
    assert set(factors(Built.policy)) == {torch.nn.Linear} and set(factors(at_load)) == {InputDtypeLinear}
    check.switch_on("lora.compute_dtype=model", Built)
    assert factors(Built.policy) == factors(at_load)
    compute_in_input_dtype(Built.policy.transformer, on=False)
    assert set(factors(Built.policy)) == {torch.nn.Linear}


def test_the_optimiser_lever_gives_a_built_trainer_the_fused_adamw(tiny_sd3_dir, tmp_path):
    """``optimizer_kernel=fused`` switched on a built trainer: a fused AdamW over the same parameters, where the
    loop's optimiser step finds it."""
    from flowalign.config import load_config
    from flowalign.train import build_trainer

    (tmp_path / "prompts.txt").write_text("a red circle\n")
    trainer = build_trainer(load_config(None, [f"model.path={tiny_sd3_dir}", f"data.prompts={tmp_path / 'prompts.txt'}",
                                               f"run.output_dir={tmp_path / 'run'}", "rewards=[{name: brightness}]",
                                               "eval.bench=null", "run.tensorboard=false", "run.progress=false"]))
    assert not trainer.optimizer.param_groups[0]["fused"]
    check.switch_on("optimizer_kernel=fused", trainer)
    assert trainer.optimizer is trainer.optimisation.optimizer and trainer.optimizer.param_groups[0]["fused"]
    assert trainer.optimizer.param_groups[0]["params"] == trainer.params


def test_the_tf32_lever_sets_what_model_allow_tf32_sets_when_a_run_starts(tiny_sd3_dir, tmp_path):
    """``model.allow_tf32`` sets CUDA's float32-product flag for the run, either way (a run's config decides,
    not an earlier run in the process); the lever switches the same flag on a built trainer."""
    from flowalign.config import load_config
    from flowalign.train import build_trainer

    (tmp_path / "prompts.txt").write_text("a red circle\n")
    built = lambda name, on: build_trainer(load_config(None, [
        f"model.path={tiny_sd3_dir}", f"data.prompts={tmp_path / 'prompts.txt'}", f"run.output_dir={tmp_path / name}",
        "rewards=[{name: brightness}]", "eval.bench=null", "run.tensorboard=false", "run.progress=false",
        f"model.allow_tf32={str(on).lower()}"]))
    before = torch.backends.cuda.matmul.allow_tf32
    try:
        built("on", True)
        assert torch.backends.cuda.matmul.allow_tf32 and torch.get_float32_matmul_precision() == "high"
        trainer = built("off", False)
        assert not torch.backends.cuda.matmul.allow_tf32 and torch.get_float32_matmul_precision() == "highest"
        check.switch_on("allow_tf32", trainer)
        assert torch.backends.cuda.matmul.allow_tf32
        assert torch.backends.mkldnn.matmul.fp32_precision != "tf32"  # a CPU's products keep float32
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


def test_recipe_children_share_the_cores(monkeypatch):
    """Recipes run ``jobs`` at a time, each child with its share of the cores; a user's OMP_NUM_THREADS wins, and a
    child run alone (a side of the side-by-side) keeps every core."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert check._child_env("cpu", 4)["OMP_NUM_THREADS"] == "4"
    assert "OMP_NUM_THREADS" not in check._child_env("cpu")
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert check._child_env("cpu", 4)["OMP_NUM_THREADS"] == "3"


def test_the_streaming_recipes_run_again_on_a_tiny_causal_wan(tmp_path, tiny_model_dir):
    """(a)'s rows: the streaming recipes once more on a causal Wan (Self-Forcing / LongLive's architecture) with
    their trainers' defaults; such a row trains its step there, on the twin's re-noising sampler."""
    twin = tiny_model_dir("causal_wan")
    recipes = [REPO / "configs/tiny" / f"{n}.yaml" for n in ("flow_grpo_vvr", "kvpo_motion", "ar_copo_motion")]
    rows = {check.row_label(*row) for row in check.recipe_rows(recipes, twin)}
    assert {f"kvpo_motion{check.DEFAULTS}{check.CAUSAL_WAN}", f"ar_copo_motion{check.DEFAULTS}{check.CAUSAL_WAN}"} <= rows
    assert not any(r.startswith("flow_grpo_vvr") and r.endswith(check.CAUSAL_WAN) for r in rows)
    assert check.recipe_rows(recipes, None) == [r for r in check.recipe_rows(recipes, twin) if r[2] is None]
    row = check.run_one_recipe(REPO / "configs/tiny/kvpo_motion.yaml", tmp_path / "run", 1, True, "cpu", True, twin)
    assert row["recipe"] == f"kvpo_motion{check.DEFAULTS}{check.CAUSAL_WAN}"
    assert row["status"] == "ok", row
