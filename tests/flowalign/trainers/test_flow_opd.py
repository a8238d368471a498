"""Flow-OPD: single-reward teachers distilled on-policy into one student, each on its own domain
(docs/methods/flow_opd.md): the authors' rule (Flow-GRPO with the step-wise KL to the routed teacher as the
reward, ``objective: kl_reward_grpo``) and the velocity distillation."""

import dataclasses
import json
import math
from collections import Counter
from pathlib import Path

import pytest
import torch

from flowalign.saved_weights import load_adapter_checked
from flowalign.config import load_config
from flowalign.errors import UserError
from flowalign.train import build_trainer, check_run
from flowalign.sampling import sde_step
from flowalign.trainers.base import StepBatch, derived_seed
from flowalign.trainers.flow_grpo import coded_kl_gap, gaussian_mean_kl
from flowalign.trainers.flow_opd import FlowOPDConfig, kl_reward_grpo_loss
from flowalign.trainers.parts.prompt_draws import per_batch_draw
from flowalign.trainers.parts.regrouped_micro_batches import inner_epoch_micro_batches
from flowalign.trainers.parts.teacher_distillation import distillation_loss
from flowalign.trainers.parts.teacher_weights import merged_tensor, read_weights
from flowalign.trainers.parts.teacher_routing import epoch_teacher, route, teacher_epoch

from .conftest import small_config, small_run
from .resume_check import assert_trains_and_resumes_bit_exactly


@pytest.fixture(scope="module")
def teachers(tmp_path_factory, tiny_sd3_dir, prompt_file):
    """``same``: an adapter equal to a fresh student's (LoRA B = 0); ``trained``: a flow_grpo run's checkpoint."""
    root = tmp_path_factory.mktemp("teachers")
    torch.manual_seed(0)
    fresh = build_trainer(small_config(root / "fresh", tiny_sd3_dir, prompt_file))
    fresh.policy.save_adapter(root / "same")
    torch.manual_seed(0)
    build_trainer(small_config(root / "run", tiny_sd3_dir, prompt_file, "trainer.max_steps=1",
                               "trainer.lr=1e-2", "run.checkpoint_every=1")).train()
    return {"same": root / "same", "trained": root / "run" / "checkpoints" / "step-000001"}


def opd(tmp_path, tiny_sd3_dir, prompt_file, teachers_yaml, *extra, objective="velocity_distillation"):
    torch.manual_seed(0)
    return build_trainer(small_config(tmp_path, tiny_sd3_dir, prompt_file, "trainer.name=flow_opd",
                                      f"trainer.objective={objective}", f"trainer.teachers={teachers_yaml}",
                                      "trainer.prompts_per_step=4", "trainer.group_size=1", "trainer.batch_size=4",
                                      *extra))


def test_route_takes_the_first_matching_teacher():
    prompts = ["a red circle", "a blue square", "a green star", "a yellow triangle"]
    assert route(prompts, ["red|blue", "green|red"]).tolist() == [0, 0, 1, -1]
    assert route(prompts, [None]).tolist() == [0, 0, 0, 0]


def test_distillation_loss_on_a_known_answer():
    v = torch.tensor([[1.0, 2.0], [0.0, 0.0]], requires_grad=True)
    vt, va = torch.tensor([[0.0, 0.0], [1.0, 1.0]]), torch.tensor([[1.0, 0.0], [0.0, 2.0]])
    loss, _ = distillation_loss(v, vt, va, torch.tensor([1.0, 0.0]), anchor_weight=0.5)
    # sample 0: mean(1, 4) + 0.5·mean(0, 4) = 3.5; sample 1 (not routed): 0.5·mean(0, 4) = 1
    torch.testing.assert_close(loss, torch.tensor([3.5, 1.0]))
    loss.sum().backward()
    torch.testing.assert_close(v.grad, torch.tensor([[1.0, 2.0 + 1.0], [0.0, -1.0]]))


def per_sample_losses(t, batch):
    from flowalign.trainers.base import SliceUnit

    return [t.loss(batch, SliceUnit(slice(n, n + 1), 1))[0].item() for n in range(len(batch.x))]


def test_a_teacher_equal_to_the_student_gives_zero_loss(tmp_path, tiny_sd3_dir, prompt_file, teachers):
    t = opd(tmp_path / "r", tiny_sd3_dir, prompt_file, f"[{{adapter: {teachers['same']}}}]",
            "trainer.cold_start_steps=0", "trainer.anchor_weight=0")
    batch = t.collect(0)
    assert batch.routed.tolist() == [1.0] * 4
    # zero up to the rounding of batch-size-dependent kernels (a trained teacher's loss is ~1e-4, see below)
    assert max(per_sample_losses(t, batch)) < 1e-10


def test_each_teacher_supervises_only_its_own_domain(tmp_path, tiny_sd3_dir, prompt_file, teachers):
    """Teacher 0 (trained) owns red/blue prompts, teacher 1 (= the student) green ones, yellow has none."""
    spec = f"[{{adapter: {teachers['trained']}, match: 'red|blue'}}, {{adapter: {teachers['same']}, match: green}}]"
    t = opd(tmp_path / "r", tiny_sd3_dir, prompt_file, spec, "trainer.cold_start_steps=0", "trainer.anchor_weight=0",
            "trainer.routing=by_prompt", "trainer.prompts_per_draw=4")  # one draw: each of the 4 prompts once
    batch = t.collect(0)
    prompts = [t.data.prompts[i] for i in t.step_indices(0)]
    losses = dict(zip(prompts, per_sample_losses(t, batch)))
    assert losses["a red circle"] > 1e-8 and losses["a blue square"] > 1e-8
    assert losses["a green star"] < 1e-10 and losses["a yellow triangle"] == 0  # yellow: no teacher term at all
    # the red row's target is the trained teacher's own velocity (loaded into a separate model)
    torch.manual_seed(0)
    other = build_trainer(small_config(tmp_path / "o", tiny_sd3_dir, prompt_file))
    load_adapter_checked(other.policy, teachers["trained"])
    n = prompts.index("a red circle")
    with torch.no_grad():
        v = other.policy.velocity(batch.x[n:n + 1, 0], batch.sigma[n:n + 1, 0], batch.cond[[n]], batch.guidance)
    torch.testing.assert_close(batch.v_teacher[n:n + 1, 0], v)
    assert not torch.equal(batch.v_teacher[n:n + 1, 0],
                           t.policy.velocity(batch.x[n:n + 1, 0], batch.sigma[n:n + 1, 0], batch.cond[[n]],
                                             batch.guidance).detach())


def test_the_cold_start_fits_the_teachers_samples_then_distillation_begins(tmp_path, tiny_sd3_dir, prompt_file,
                                                                           teachers):
    t = opd(tmp_path / "r", tiny_sd3_dir, prompt_file, f"[{{adapter: {teachers['trained']}}}]",
            "trainer.cold_start_steps=1")
    cold, warm = t.collect(0), t.collect(1)
    assert cold.logs["stage"] == 0 and cold.guidance == 1.0 and cold.x.shape[1] == 1
    assert warm.logs["stage"] == 1 and warm.x.shape[1] == t.tcfg.num_steps and warm.v_anchor is not None


def test_a_missing_teacher_is_named_when_training_starts(tmp_path, tiny_sd3_dir, prompt_file):
    check_run(load_config(None, small_run(tmp_path / "r", tiny_sd3_dir, prompt_file, "trainer.name=flow_opd",
                                          "trainer.teachers=[{adapter: /no/such/run}]")))  # plan, --check: fine
    with pytest.raises(UserError, match="/no/such/run.* does not exist; train the teacher first"):
        opd(tmp_path / "t", tiny_sd3_dir, prompt_file, "[{adapter: /no/such/run}]")


@pytest.mark.parametrize("bad,match", [("[{adapter: ADAPTER, reward: ocr}]", "not one of the run's rewards"),
                                       ("[{adapter: ADAPTER, match: '(unclosed'}]", "not a regular expression")])
def test_bad_teachers_name_the_field(tmp_path, tiny_sd3_dir, prompt_file, teachers, bad, match):
    spec = bad.replace("ADAPTER", str(teachers["same"]))
    with pytest.raises(UserError, match=match):
        check_run(load_config(None, small_run(tmp_path / "r", tiny_sd3_dir, prompt_file, "trainer.name=flow_opd",
                                              f"trainer.teachers={spec}")))


def test_the_distillation_trains_and_resumes_bit_exactly(tmp_path, tiny_sd3_dir, prompt_file, teachers):
    assert_trains_and_resumes_bit_exactly(tmp_path, tiny_sd3_dir, prompt_file, "trainer.name=flow_opd",
                                          "trainer.objective=velocity_distillation", "trainer.group_size=1",
                                          f"trainer.teachers=[{{adapter: {teachers['trained']}}}]",
                                          "trainer.cold_start_steps=1", "trainer.states_per_sample=2")


def test_a_teacher_no_prompt_is_routed_to_is_warned_about(tmp_path, tiny_sd3_dir, prompt_file, teachers, capsys):
    same = teachers["same"]
    opd(tmp_path / "r", tiny_sd3_dir, prompt_file,
        f"[{{adapter: {same}, match: red}}, {{adapter: {same}, match: 'red circle'}}, {{adapter: {same}, match: purple}}]",
        "trainer.routing=by_prompt")
    warned = [line for line in capsys.readouterr().out.splitlines() if line.startswith("warning: trainer.teachers[")]
    # [1] only ever matches what [0] takes first; [2] matches nothing; [0] is used
    assert [line[: len("warning: trainer.teachers[1]")] for line in warned] == \
        ["warning: trainer.teachers[1]", "warning: trainer.teachers[2]"]
    assert "match='purple') is the first match of none of the 4 training prompts" in warned[1]


# ---------------------------------------------------------------------------------------------- the authors' rule

KNOWN = json.loads((Path(__file__).parent / "known_answers" / "flow_opd_kl_reward_loss.json").read_text())


def known(case, *names):
    return [torch.tensor(case[n], dtype=torch.float64) for n in names]


@pytest.mark.parametrize("case", KNOWN["cases"], ids=lambda c: f"step{c['step']}")
def test_the_kl_reward_loss_equals_the_authors(case):
    """The authors' kl_only block and GRPO loss on fixed float64 tensors (known_answers/): the KL reward, the
    clipped advantage, the surrogate with their (B, 1) × (B,) pairing, the β term, and the gradient with
    respect to the log-probs and the step means (their advantage is not detached)."""
    cfg = KNOWN["cfg"]
    log_prob, old, mean, teacher, anchor, std_dev_t, sqrt_dt = known(
        case, "log_prob", "old_log_prob", "prev_sample_mean", "teacher_prev_sample_mean", "anchor_prev_sample_mean",
        "std_dev_t", "sqrt_dt")
    log_prob.requires_grad_(), mean.requires_grad_()
    tau, gap = (std_dev_t * sqrt_dt).view(-1, 1, 1, 1), (sqrt_dt[0] ** 2).item()  # the step's std and σ gap
    got = kl_reward_grpo_loss(log_prob, old, mean, teacher, tau, gap, kl_scale=cfg["kl_scale"],
                              adv_clip=cfg["adv_clip_max"], clip_range=cfg["clip_range"])
    kl = gaussian_mean_kl(mean, anchor, tau, gap, "code").mean()
    loss = got.loss + cfg["beta"] * kl
    close = dict(rtol=1e-6, atol=0)
    for name, value in (("kl_reward", got.kl), ("advantages", got.advantages), ("ratio", got.ratio)):
        torch.testing.assert_close(value, torch.tensor(case[name], dtype=torch.float64), **close, msg=name)
    for name, value in (("policy_loss", got.loss), ("kl_loss", kl), ("loss", loss)):
        assert math.isclose(value.item(), case[name], rel_tol=1e-6), (name, value.item(), case[name])
    loss.backward()
    torch.testing.assert_close(log_prob.grad, torch.tensor(case["grad_log_prob"], dtype=torch.float64), **close)
    torch.testing.assert_close(mean.grad, torch.tensor(case["grad_prev_sample_mean"], dtype=torch.float64), **close)
    own = kl_reward_grpo_loss(log_prob, old, mean, teacher, tau, gap, kl_scale=cfg["kl_scale"],
                              adv_clip=cfg["adv_clip_max"], clip_range=cfg["clip_range"], pairing="sample")
    assert math.isclose(own.loss.item(), case["policy_loss_sample_pairing"], rel_tol=1e-6)
    assert not math.isclose(own.loss.item(), case["policy_loss"], rel_tol=1e-4)  # the pairing matters


def test_the_known_answers_exercise_the_clamp_and_both_clip_branches():
    cfg = KNOWN["cfg"]
    advantages = [a for c in KNOWN["cases"] for a in c["advantages"]]
    ratios = [r for c in KNOWN["cases"] for r in c["ratio"]]
    assert -cfg["adv_clip_max"] in advantages and max(advantages) < 0  # one KL past adv_clip, all rewards < 0
    eps = cfg["clip_range"]
    assert any(r < 1 - eps for r in ratios) and any(r > 1 + eps for r in ratios) and \
        any(abs(r - 1) <= eps for r in ratios)


@pytest.mark.parametrize("case", KNOWN["cases"], ids=lambda c: f"step{c['step']}")
def test_flowalign_steps_give_the_authors_step_means_and_kl_scale(case):
    """The trainer's inputs to the loss: its Flow-GRPO step (float32) gives the authors' step means for the
    policy's, the teacher's and the anchor's velocities, and τ²/coded_kl_gap is their std_dev_t²."""
    sigmas, k = KNOWN["sigmas"], case["step"]
    x, x_next = known(case, "sample", "sample_next")
    assert math.isclose(coded_kl_gap("flow_grpo", sigmas[k], sigmas[k + 1]), case["sqrt_dt"][0] ** 2, rel_tol=1e-12)
    for velocity, mean in (("velocity", "prev_sample_mean"), ("teacher_velocity", "teacher_prev_sample_mean"),
                           ("anchor_velocity", "anchor_prev_sample_mean")):
        out = sde_step("flow_grpo", torch.tensor(case[velocity]), x, sigmas[k], sigmas[k + 1],
                       noise_level=KNOWN["cfg"]["noise_level"], prev_sample=x_next)
        torch.testing.assert_close(out.mean.double(), torch.tensor(case[mean], dtype=torch.float64), rtol=1e-5,
                                   atol=1e-6)
    tau = out.std.flatten()[0].item()
    assert math.isclose(tau / case["sqrt_dt"][0], case["std_dev_t"][0], rel_tol=1e-6)


def grpo_units(t, batch):
    plan = t.plan(batch, torch.Generator().manual_seed(0))
    return [u for step in plan.steps for u in step]


def test_a_teacher_equal_to_the_student_gives_zero_reward_loss_and_gradient(tmp_path, tiny_sd3_dir, prompt_file,
                                                                            teachers):
    t = opd(tmp_path / "r", tiny_sd3_dir, prompt_file, f"[{{adapter: {teachers['same']}}}]", "trainer.beta=0",
            objective="kl_reward_grpo")
    batch = t.collect(0)
    for unit in grpo_units(t, batch):
        assert unit.trained.all() and unit.teacher is not None
        loss, info = t.loss(batch, unit)
        loss.backward()
        assert info["kl_teacher"] < 1e-12 and abs(loss.item()) < 1e-12
    assert max(p.grad.abs().max().item() for p in t.params if p.grad is not None) < 1e-10


def test_the_kl_reward_routes_each_prompt_to_its_own_teacher(tmp_path, tiny_sd3_dir, prompt_file, teachers):
    """Teacher 0 (trained) owns red/blue prompts, teacher 1 (= the student) green ones, yellow has none: yellow
    is not trained, green's KL is 0, and a red row's teacher mean is the trained teacher's own step mean."""
    spec = f"[{{adapter: {teachers['trained']}, match: 'red|blue'}}, {{adapter: {teachers['same']}, match: green}}]"
    t = opd(tmp_path / "r", tiny_sd3_dir, prompt_file, spec, "trainer.beta=0", "trainer.routing=by_prompt",
            "trainer.prompts_per_draw=4", objective="kl_reward_grpo")  # one draw: each of the 4 prompts once
    batch = t.collect(0)
    assert batch.logs["route/teacher0_fraction"] == 0.5 and batch.logs["route/teacher1_fraction"] == 0.25
    units = grpo_units(t, batch)
    chunk, unit = batch.chunks[0], units[0]
    prompts = chunk.prompts
    assert unit.trained.tolist() == ["yellow" not in p for p in prompts]
    out = t.step_distribution(chunk, unit.k, t.policy_velocity(chunk, unit.k, True))
    tau, gap = out.std, coded_kl_gap("flow_grpo", chunk.sigmas[unit.k].item(), chunk.sigmas[unit.k + 1].item())
    kl = gaussian_mean_kl(out.mean, unit.teacher, tau, gap, "code").detach()
    by_prompt = dict(zip(prompts, kl.tolist()))
    assert by_prompt["a red circle"] > 1e-8 and by_prompt["a blue square"] > 1e-8 and by_prompt["a green star"] < 1e-10
    torch.manual_seed(0)
    other = build_trainer(small_config(tmp_path / "o", tiny_sd3_dir, prompt_file))
    load_adapter_checked(other.policy, teachers["trained"])
    n = prompts.index("a red circle")
    x_k = chunk.step(unit.k)[0]
    with torch.no_grad():
        v = other.policy.velocity(x_k, chunk.sigmas[unit.k].item(), chunk.cond, chunk.guidance_scale)
    expected = t.step_distribution(chunk, unit.k, v).mean
    torch.testing.assert_close(unit.teacher[n], expected[n])
    loss, info = t.loss(batch, unit)
    assert loss.item() > 0 and info["kl_teacher"] > 0


def test_drop_zero_advantage_leaves_out_samples_whose_task_advantage_is_zero(tmp_path, tiny_sd3_dir, prompt_file,
                                                                             teachers):
    t = opd(tmp_path / "r", tiny_sd3_dir, prompt_file, f"[{{adapter: {teachers['trained']}, match: 'red|blue|green'}}]",
            "trainer.drop_zero_advantage=true", "trainer.group_size=2", "trainer.prompts_per_step=2",
            "trainer.routing=by_prompt", objective="kl_reward_grpo")
    batch = t.collect(0)
    zeroed = dataclasses.replace(batch, advantages=torch.tensor([0.5, 0.0, -0.5, 0.0]))
    routed = torch.tensor(["yellow" not in p for p in batch.prompts])
    assert t.trained(zeroed).tolist() == (routed & torch.tensor([True, False, True, False])).tolist()
    t.tcfg = t.tcfg.model_copy(update={"drop_zero_advantage": False})
    assert t.trained(zeroed).tolist() == routed.tolist()


def test_the_default_objective_is_the_authors_with_no_cold_start(tmp_path, tiny_sd3_dir, prompt_file, teachers):
    t = build_trainer(small_config(tmp_path / "r", tiny_sd3_dir, prompt_file, "trainer.name=flow_opd",
                                   f"trainer.teachers=[{{adapter: {teachers['same']}}}]"))
    assert t.tcfg.objective == "kl_reward_grpo" and t.cold_start_steps == 0 and t.tcfg.cfg_grad == "full"
    assert t.tcfg.routing == "by_epoch"  # the authors' alternate training
    # the authors' mix_opd_8gpu values (group_size: their num_image_per_prompt; lr: their learning_rate)
    defaults = {k: f.default for k, f in type(t.tcfg).model_fields.items()}
    assert [defaults[k] for k in ("kl_scale", "beta", "clip_range", "adv_clip", "timestep_fraction", "noise_level",
                                  "group_size", "lr", "advantage_pairing")] == \
        [-1.0, 0.04, 1e-4, 5.0, 0.99, 0.7, 16, 1e-4, "batch"]
    batch = t.collect(0)
    assert isinstance(batch, StepBatch) and batch.logs["stage"] == 1.0
    d = opd(tmp_path / "d", tiny_sd3_dir, prompt_file, f"[{{adapter: {teachers['same']}}}]")
    assert d.cold_start_steps == 20


@pytest.mark.parametrize("setting,match", [("trainer.kl_scale=0", "every advantage 0"),
                                           ("rewards=[]", "drop_zero_advantage needs task advantages")])
def test_settings_that_would_train_nothing_are_refused(tmp_path, tiny_sd3_dir, prompt_file, teachers, setting, match):
    extra = ("trainer.drop_zero_advantage=true",) if setting == "rewards=[]" else ()
    with pytest.raises(UserError, match=match):
        check_run(load_config(None, small_run(tmp_path / "r", tiny_sd3_dir, prompt_file, "trainer.name=flow_opd",
                                              f"trainer.teachers=[{{adapter: {teachers['same']}}}]", setting, *extra)))


def test_the_kl_reward_trains_without_rewards(tmp_path, tiny_sd3_dir, prompt_file, teachers):
    t = opd(tmp_path / "r", tiny_sd3_dir, prompt_file, f"[{{adapter: {teachers['trained']}}}]", "rewards=[]",
            objective="kl_reward_grpo")
    logs = t.train_step()
    assert not any(k.startswith("reward/") for k in logs) and logs["train/kl_teacher"] > 0


@pytest.mark.parametrize("inner_epochs", [1, 2])
def test_the_kl_reward_trains_and_resumes_bit_exactly(tmp_path, tiny_sd3_dir, prompt_file, teachers, inner_epochs):
    """With an anchor checkpoint as the β term's reference (the authors' mar_lora), two optimiser steps, and
    two teachers alternating by epoch: the resumed step is the second teacher's. Two inner epochs (micro-batches
    of 2 of the step's 4 samples): the second trains micro-batches re-formed from them, drawn alike after the
    resume."""
    spec = f"[{{adapter: {teachers['trained']}, match: 'red|blue'}}, {{adapter: {teachers['same']}}}]"
    epochs = (f"trainer.inner_epochs={inner_epochs}", "trainer.batch_size=2") if inner_epochs > 1 else ()
    assert_trains_and_resumes_bit_exactly(tmp_path, tiny_sd3_dir, prompt_file, "trainer.name=flow_opd",
                                          f"trainer.teachers={spec}",
                                          f"trainer.anchor={teachers['same']}", "trainer.group_size=2",
                                          "trainer.updates_per_epoch=2", *epochs)


@pytest.mark.parametrize("objective,other,unread", [("velocity_distillation", "trainer.clip_range=0.01", "clip_range"),
                                                    ("kl_reward_grpo", "trainer.anchor_weight=0.5", "anchor_weight")])
def test_an_option_of_the_other_objective_is_reported(tmp_path, tiny_sd3_dir, prompt_file, teachers, capsys,
                                                      objective, other, unread):
    check_run(load_config(None, small_run(tmp_path / "r", tiny_sd3_dir, prompt_file, "trainer.name=flow_opd",
                                          f"trainer.objective={objective}",
                                          f"trainer.teachers=[{{adapter: {teachers['same']}}}]", other)))
    warned = [line for line in capsys.readouterr().out.splitlines() if line.startswith("warning: objective:")]
    assert warned == [f"warning: objective: {objective} does not read trainer.{unread} (set for the other "
                      "objective); drop them or change trainer.objective"]


# ---------------------------------------------------------------------------------------------- epoch routing

EPOCHS = json.loads((Path(__file__).parent / "known_answers" / "flow_opd_epoch_routing.json").read_text())


@pytest.mark.parametrize("case", EPOCHS["cases"], ids=lambda c: "-".join(map(str, c["epochs_per_cycle"])))
def test_the_epoch_routing_equals_the_authors(case):
    """Each step's teacher is the dataset the authors' get_current_dataset_idx trains that epoch on (known_answers/,
    24 epochs; [1, 3] is their mix_opd_8gpu), and each teacher's own draw index counts its steps 0, 1, 2, ..."""
    shares = case["epochs_per_cycle"]
    assert [epoch_teacher(e, shares) for e in range(24)] == case["dataset_idx"]
    for i in range(len(shares)):
        own = [teacher_epoch(e, shares) for e in range(24) if epoch_teacher(e, shares) == i]
        assert own == list(range(len(own))) and len(own) == 24 // sum(shares) * shares[i] + \
            min(max(24 % sum(shares) - sum(shares[:i]), 0), shares[i])


def test_epoch_routing_gives_each_step_one_teacher_and_its_domain(tmp_path, tiny_sd3_dir, prompt_file, teachers):
    """Teacher 0 (trained; red/blue) takes 1 step of each cycle of 3, teacher 1 (= the student; the rest) 2: each
    step's prompts come from its teacher's domain, every sample is trained, and its KL is to that teacher."""
    spec = (f"[{{adapter: {teachers['trained']}, match: 'red|blue'}}, "
            f"{{adapter: {teachers['same']}, epochs_per_cycle: 2}}]")
    t = opd(tmp_path / "r", tiny_sd3_dir, prompt_file, spec, "trainer.beta=0", "trainer.prompts_per_step=2",
            objective="kl_reward_grpo")
    domains = [{"a red circle", "a blue square"}, {"a green star", "a yellow triangle"}]
    for step, teacher in enumerate([0, 1, 1, 0]):
        t.step = step
        batch = t.collect(step)
        assert set(batch.prompts) == domains[teacher], step  # 2 prompts a step: the whole 2-prompt domain
        assert batch.logs[f"route/teacher{teacher}_fraction"] == 1.0 and batch.logs[f"route/teacher{1 - teacher}_fraction"] == 0
        for unit in grpo_units(t, batch):
            assert unit.trained.all()
            _, info = t.loss(batch, unit)
            assert (info["kl_teacher"] > 1e-8) if teacher == 0 else (info["kl_teacher"] < 1e-12), (step, unit.k)


def test_a_teacher_draws_from_its_own_prompt_file_under_epoch_routing(tmp_path, tiny_sd3_dir, prompt_file, teachers):
    """Teacher 1 (= the student) draws its steps from its own file, whose prompts teacher 0's match (red) would
    take when routing by prompt: under epoch routing they are teacher 1's, so their KL is 0."""
    own = tmp_path / "own.jsonl"
    own.write_text('{"prompt": "a red hexagon", "task": 7}\n{"prompt": "a red ring", "task": 8}\n')
    spec = f"[{{adapter: {teachers['trained']}, match: red}}, {{adapter: {teachers['same']}, prompts: {own}}}]"
    t = opd(tmp_path / "r", tiny_sd3_dir, prompt_file, spec, "trainer.prompts_per_step=2", "trainer.beta=0",
            objective="kl_reward_grpo")
    assert t.step_prompts(0)[0] == ["a red circle"] * 2  # teacher 0's domain: the data prompts its match finds
    prompts, metadata, _ = t.step_prompts(1)
    assert sorted(prompts) == ["a red hexagon", "a red ring"] and sorted(m["task"] for m in metadata) == [7, 8]
    t.step = 1
    batch = t.collect(1)
    for unit in grpo_units(t, batch):
        assert t.loss(batch, unit)[1]["kl_teacher"] < 1e-12


@pytest.mark.parametrize("routing,spec,match", [
    ("by_prompt", "[{adapter: ADAPTER, prompts: /some/file.txt}]", r"teachers\[0\]\.prompts is read only under"),
    ("by_prompt", "[{adapter: ADAPTER, epochs_per_cycle: 3}]", r"teachers\[0\]\.epochs_per_cycle is read only under"),
    ("by_epoch", "[{adapter: ADAPTER, match: purple}]", r"teachers\[0\] \(match='purple'\) has no prompt")])
def test_routing_options_that_cannot_apply_are_refused(tmp_path, tiny_sd3_dir, prompt_file, teachers, routing, spec,
                                                        match):
    with pytest.raises(UserError, match=match):
        opd(tmp_path / "r", tiny_sd3_dir, prompt_file, spec.replace("ADAPTER", str(teachers["same"])),
            f"trainer.routing={routing}")


# ---------------------------------------------------------------------------------------------- the prompt draw

DRAWS = json.loads((Path(__file__).parent / "known_answers" / "flow_opd_prompt_draw.json").read_text())


def their_setting(case) -> tuple[int, int]:
    """``(m, k)``: the prompts of one of their batches (GPUs × train_batch_size / num_image_per_prompt) and
    each one's repeats."""
    k = case["num_image_per_prompt"]
    return case["num_replicas"] * case["train_batch_size"] // k, k


@pytest.mark.parametrize("case", DRAWS["cases"],
                         ids=lambda c: f"n{c['dataset_size']}-W{c['num_replicas']}-b{c['train_batch_size']}"
                                       f"-k{c['num_image_per_prompt']}-e{c['set_epoch']}")
def test_a_draw_is_the_authors_samplers_batch(case):
    """One draw of ``per_batch_draw`` seeded as their sampler (42 + set_epoch) gives the prompts their ranks
    yield for that batch, each num_image_per_prompt times over the ranks (their shuffle only places them)."""
    m, k = their_setting(case)
    theirs = Counter(i for rank in case["per_rank"] for i in rank)
    ours = per_batch_draw(case["dataset_size"], m, m,
                          lambda b: torch.Generator().manual_seed(case["sampler_seed"] + case["set_epoch"]))
    assert len(set(ours)) == m and Counter(i for i in ours for _ in range(k)) == theirs


def test_successive_draws_are_the_authors_successive_batches():
    """A step of several draws is their batches of consecutive set_epoch values concatenated: independent
    draws, so a prompt may come again (their epoch of num_batches_per_epoch batches)."""
    cases = [c for c in DRAWS["cases"] if (c["dataset_size"], c["num_replicas"]) == (40, 8)]
    m, _ = their_setting(cases[0])
    ours = per_batch_draw(40, m * len(cases), m, lambda b: torch.Generator().manual_seed(42 + cases[b]["set_epoch"]))
    assert [sorted(ours[b * m:(b + 1) * m]) for b in range(len(cases))] == \
        [sorted(set(sum(c["per_rank"], []))) for c in cases]
    # a cut draw: the first count of the concatenation; a draw larger than the source takes it whole
    assert per_batch_draw(40, 3, m, lambda b: torch.Generator().manual_seed(42 + cases[b]["set_epoch"])) == ours[:3]
    assert sorted(per_batch_draw(3, 3, 5, lambda b: torch.Generator().manual_seed(b))) == [0, 1, 2]


def test_a_step_draws_its_prompts_per_batch_keyed_by_seed_and_step(tmp_path, tiny_sd3_dir, prompt_file, teachers):
    """The default: the step's prompts are per_batch_draw keyed by (seed, step, draw), from the step's teacher's
    source under by_epoch; per_pass (the former draw, as saved runs computed) the loop's pass permutation."""
    spec = f"[{{adapter: {teachers['same']}}}]"
    t = opd(tmp_path / "r", tiny_sd3_dir, prompt_file, spec, "trainer.prompts_per_step=3", objective="kl_reward_grpo")
    assert t.tcfg.prompt_draw == "per_batch" and t.tcfg.prompts_per_draw == 2
    n = len(t.data.prompts)
    for step in range(6):
        assert t.step_indices(step) == per_batch_draw(n, 3, 2, lambda b: torch.Generator().manual_seed(
            derived_seed(t.cfg.run.seed, step, b, 101)))
    repeats = [step for step in range(40) if len(set(t.step_indices(step))) < 3]
    assert repeats  # independent draws of 2 of 4 prompts: a prompt comes again in a step now and then
    assert FlowOPDConfig.before["prompt_draw"] == "per_pass"
    former = opd(tmp_path / "p", tiny_sd3_dir, prompt_file, spec, "trainer.prompts_per_step=3",
                 "trainer.prompt_draw=per_pass", objective="kl_reward_grpo")
    assert [former.step_indices(s) for s in range(4)] == [former.data.batch_indices(former.cfg.run.seed, s, 3)
                                                          for s in range(4)]


def test_micro_batches_are_a_keyed_shuffle_of_the_ranks_samples(tmp_path, tiny_sd3_dir, prompt_file, teachers):
    """The default cuts the step's samples into chunks (the micro-batches the KL reward pairs over) after a
    permutation keyed by (seed, step, rank), as the authors' per-rank ``randperm`` before their rebatching;
    ``in_order`` (the former form, as saved runs computed) keeps each group's samples together. The samples
    themselves are the same either way: their noise is keyed by group and member."""
    spec = f"[{{adapter: {teachers['same']}}}]"
    args = ("trainer.prompts_per_step=2", "trainer.group_size=2", "trainer.batch_size=2", "trainer.beta=0")
    t = opd(tmp_path / "s", tiny_sd3_dir, prompt_file, spec, *args, objective="kl_reward_grpo")
    former = opd(tmp_path / "o", tiny_sd3_dir, prompt_file, spec, *args, "trainer.micro_batches=in_order",
                 objective="kl_reward_grpo")
    assert t.tcfg.micro_batches == "shuffled" and FlowOPDConfig.before["micro_batches"] == "in_order"
    step = 1
    shuffled, ordered = t.collect(step), former.collect(step)
    assert [len(c.prompts) for c in shuffled.chunks] == [2, 2] and ordered.groups.tolist() == [0, 0, 1, 1]
    perm = torch.randperm(4, generator=torch.Generator().manual_seed(derived_seed(t.cfg.run.seed, step, 0, 103)))
    assert shuffled.groups.tolist() == ordered.groups[perm].tolist()
    assert shuffled.groups[:2].unique().numel() == 2  # this step's first micro-batch holds both prompts' samples
    torch.testing.assert_close(shuffled.samples, ordered.samples[perm])
    # and the loss pairs within each shuffled chunk: a unit's trained mask has the chunk's size
    assert all(u.trained.numel() == 2 for u in grpo_units(t, shuffled))


def epoch_micro_batches(t, batch) -> list[list[tuple[int, ...]]]:
    """Each inner epoch's micro-batches in the plan (``updates_per_epoch`` 1: optimiser step e is inner epoch
    e), as rows of the step batch in their order, sorted, each checked to train all its steps."""
    starts = torch.tensor([0] + [len(c) for c in batch.chunks]).cumsum(0).tolist()
    epochs = []
    for units in t.plan(batch, torch.Generator().manual_seed(0)).steps:
        steps: dict[tuple[int, ...], list[int]] = {}
        for u in units:
            rows = u.rows if u.rows is not None else tuple(range(starts[u.chunk], starts[u.chunk + 1]))
            assert u.trained.numel() == len(rows)
            steps.setdefault(rows, []).append(u.k)
        assert all(ks == t.trained_steps(batch.chunks[0]) for ks in steps.values())
        epochs.append(sorted(steps))
    return epochs


OPD_EPOCHS = ("trainer.prompts_per_step=3", "trainer.group_size=2", "trainer.batch_size=2", "trainer.beta=0",
              "trainer.inner_epochs=3")


def test_each_inner_epoch_reshuffles_the_micro_batches(tmp_path, tiny_sd3_dir, prompt_file, teachers):
    """The default (``shuffle_draw: per_inner_epoch``): each inner epoch trains every sample once, in micro-batches
    cut from epoch e − 1's order permuted again by a generator keyed by (seed, step, rank, e); epoch 0's are the
    rollout chunks. ``per_step`` (the former form, as saved runs computed) trains the rollout chunks again in
    every epoch; with one inner epoch the two plan alike."""
    spec = f"[{{adapter: {teachers['same']}}}]"
    t = opd(tmp_path / "s", tiny_sd3_dir, prompt_file, spec, *OPD_EPOCHS, objective="kl_reward_grpo")
    former = opd(tmp_path / "o", tiny_sd3_dir, prompt_file, spec, *OPD_EPOCHS, "trainer.shuffle_draw=per_step",
                 objective="kl_reward_grpo")
    assert t.tcfg.shuffle_draw == "per_inner_epoch" and FlowOPDConfig.before["shuffle_draw"] == "per_step"
    assert FlowOPDConfig.before_when["shuffle_draw"][0] == "inner_epochs"
    assert 1 not in FlowOPDConfig.before_when["shuffle_draw"][1]
    assert {2, 3, 1024} <= set(FlowOPDConfig.before_when["shuffle_draw"][1])
    t.step = former.step = step = 1
    batch = t.collect(step)
    epochs = epoch_micro_batches(t, batch)
    assert len(epochs) == 3 and epochs[0] == [(0, 1), (2, 3), (4, 5)]  # the rollout chunks
    order = torch.arange(6)
    for e, micro in enumerate(epochs):
        assert sorted(r for rows in micro for r in rows) == list(range(6))  # every sample once an epoch
        if e:
            order = order[torch.randperm(6, generator=torch.Generator().manual_seed(
                derived_seed(t.cfg.run.seed, step, 0, e, 103)))]
            assert micro == sorted(tuple(order[i : i + 2].tolist()) for i in range(0, 6, 2))
    assert len({frozenset(frozenset(m) for m in micro) for micro in epochs}) == 3  # three different groupings
    assert epoch_micro_batches(former, batch) == [epochs[0]] * 3  # the former form: the same chunks each epoch
    one = [opd(tmp_path / f"one{i}", tiny_sd3_dir, prompt_file, spec, *OPD_EPOCHS, "trainer.inner_epochs=1", *extra,
               objective="kl_reward_grpo") for i, extra in enumerate([(), ("trainer.shuffle_draw=per_step",)])]
    first = former.plan(batch, torch.Generator().manual_seed(0)).steps[0]
    assert [[(u.chunk, u.k, u.update, u.rows) for u in grpo_units(o, batch)] for o in one] == \
           [[(u.chunk, u.k, u.update, None) for u in first]] * 2


def test_the_reshuffled_micro_batches_are_the_authors(tmp_path, tiny_sd3_dir, prompt_file, teachers):
    """Known answer: the authors' inner-epoch loop (train_sd3_opd_mix.py @ 434ab16, l. 1468-1479: ``perm =
    torch.randperm(total_batch_size)``, ``samples = {k: v[perm]}``, reshaped into num_batches_per_epoch rows)
    driven on 6 samples in the prompts' order (3 prompts × 2), 3 micro-batches, with the generators flowalign
    keys for seed 0, step 1, rank 0 (epoch 0: derived_seed(0, 1, 0, 103); epoch e: derived_seed(0, 1, 0, e,
    103)) in place of their device RNG, gave these micro-batches (prompt-order indices, in their order). The
    plan's equal them, each sample found by its image among an ``in_order`` run's samples."""
    authors = [[[2, 0], [5, 3], [4, 1]], [[4, 5], [0, 3], [2, 1]], [[0, 4], [3, 1], [2, 5]]]
    spec = f"[{{adapter: {teachers['same']}}}]"
    t = opd(tmp_path / "s", tiny_sd3_dir, prompt_file, spec, *OPD_EPOCHS, objective="kl_reward_grpo")
    ordered = opd(tmp_path / "o", tiny_sd3_dir, prompt_file, spec, *OPD_EPOCHS, "trainer.micro_batches=in_order",
                  objective="kl_reward_grpo")
    assert t.cfg.run.seed == 0
    t.step = ordered.step = 1
    batch, reference = t.collect(1), ordered.collect(1)
    assert reference.groups.tolist() == [0, 0, 1, 1, 2, 2]
    distance = (batch.samples[:, None] - reference.samples[None]).flatten(2).abs().amax(2)
    prompt_order = distance.argmin(1)
    assert sorted(prompt_order.tolist()) == list(range(6)) and distance.min(1).values.max() < 1e-4
    got = [sorted(tuple(prompt_order[list(rows)].tolist()) for rows in micro)
           for micro in epoch_micro_batches(t, batch)]
    assert got == [sorted(tuple(m) for m in epoch) for epoch in authors]


@dataclasses.dataclass
class KindsOnly:
    """A rollout chunk as :func:`inner_epoch_micro_batches` reads it: its length and its SDE steps."""

    size: int
    sde_mask: torch.Tensor

    def __len__(self) -> int:
        return self.size


def test_samples_of_other_sde_steps_never_share_a_re_formed_micro_batch():
    """Epoch 0's micro-batches are the rollout chunks; a later epoch cuts each kind of SDE steps (an sde_window
    per group) from the permuted order on its own, so every sample comes once and no micro-batch mixes kinds."""
    first, second = torch.tensor([True, False]), torch.tensor([False, True])
    chunks = [KindsOnly(2, first), KindsOnly(2, second), KindsOnly(2, first)]
    kind = [0, 0, 1, 1, 0, 0]
    epochs = inner_epoch_micro_batches(chunks, 2, 4, lambda e: torch.Generator().manual_seed(e))
    assert len(epochs) == 4 and epochs[0] == [(0, 1), (2, 3), (4, 5)]
    for micro in epochs[1:]:
        assert sorted(r for rows in micro for r in rows) == list(range(6))
        assert all(len(rows) == 2 and len({kind[r] for r in rows}) == 1 for rows in micro)
    assert len({frozenset(frozenset(m) for m in micro) for micro in epochs}) > 1


def test_a_reshuffled_micro_batch_computes_the_loss_of_the_same_samples_in_a_chunk(tmp_path, tiny_sd3_dir,
                                                                                   prompt_file, teachers):
    """A re-formed micro-batch reads its samples' trajectories, teacher and reference means and trained flags from
    the step's chunks: holding one chunk's rows, its loss and gradient are the chunk unit's, bit for bit."""
    spec = f"[{{adapter: {teachers['trained']}}}]"
    t = opd(tmp_path / "s", tiny_sd3_dir, prompt_file, spec, *OPD_EPOCHS, "trainer.beta=0.04",
            objective="kl_reward_grpo")
    t.step = 1
    batch = t.collect(1)
    units = grpo_units(t, batch)
    chunk_unit = next(u for u in units if u.rows is None and u.chunk == 1)
    regrouped = next(u.regrouped for u in units if u.rows is not None)
    assert chunk_unit.teacher is not None and chunk_unit.reference is not None
    same = dataclasses.replace(chunk_unit, rows=(2, 3), regrouped=regrouped, teacher=None, reference=None)
    results = []
    for unit in (chunk_unit, same):
        t.optimizer.zero_grad()
        loss, info = t.loss(batch, unit)
        loss.backward()
        results.append((loss.detach(), info["kl_teacher"], info["kl"], [p.grad.clone() for p in t.params]))
    (a, kl_a, ref_a, grad_a), (b, kl_b, ref_b, grad_b) = results
    assert torch.equal(a, b) and torch.equal(kl_a, kl_b) and torch.equal(ref_a, ref_b) and a != 0
    assert all(torch.equal(x, y) for x, y in zip(grad_a, grad_b))
    torch.testing.assert_close(regrouped.rollout((2, 3)).latents, batch.chunks[1].latents, rtol=0, atol=0)


MERGES = json.loads((Path(__file__).parent / "known_answers" / "flow_opd_merge.json").read_text())


@pytest.mark.parametrize("mode", list(MERGES["merges"]))
def test_merged_teachers_equal_the_authors_merge_script(mode):
    """Their ``merge_lora_weights``: each key's tensors averaged, summed, or weighted by weights / sum(weights)."""
    case = MERGES["merges"][mode]
    for key in MERGES["keys"]:
        tensors = [torch.tensor(a[key]) for a in MERGES["adapters"]]
        got = merged_tensor(tensors, mode.split("_")[0], case["weights"])
        torch.testing.assert_close(got, torch.tensor(case["merged"][key]), rtol=1e-6, atol=1e-7)


def test_the_student_starts_from_the_merged_teachers(tmp_path, tiny_sd3_dir, prompt_file, teachers):
    """merge_teachers: the student's trained tensors start as the teachers' merged (the β term's reference stays
    the adapter-disabled base, as theirs); without it they start fresh; merge_weights goes with weighted only."""
    spec = f"[{{adapter: {teachers['same']}}}, {{adapter: {teachers['trained']}}}]"
    t = opd(tmp_path / "m", tiny_sd3_dir, prompt_file, spec, "trainer.merge_teachers=weighted",
            "trainer.merge_weights=[3, 1]", "trainer.routing=by_prompt", objective="kl_reward_grpo")
    fresh = opd(tmp_path / "f", tiny_sd3_dir, prompt_file, spec, "trainer.routing=by_prompt",
                objective="kl_reward_grpo")
    named = {n: p for n, p in fresh.policy.trainable.named_parameters() if p.requires_grad}
    same, trained = (read_weights(fresh.policy, named, str(teachers[k])) for k in ("same", "trained"))
    moved = 0
    for (n, p), q in zip(named.items(), t.params):
        torch.testing.assert_close(q.detach(), 0.75 * same[n] + 0.25 * trained[n])
        moved += int(not torch.equal(q.detach(), p.detach()))
    assert moved > 0  # the trained teacher's tensors differ from a fresh adapter's
    with pytest.raises(UserError, match="merge_weights goes with"):
        opd(tmp_path / "w", tiny_sd3_dir, prompt_file, spec, "trainer.merge_weights=[1, 1]", "trainer.routing=by_prompt",
            objective="kl_reward_grpo")
    with pytest.raises(UserError, match="give 2 weights"):
        opd(tmp_path / "n", tiny_sd3_dir, prompt_file, spec, "trainer.merge_teachers=weighted",
            "trainer.merge_weights=[1]", "trainer.routing=by_prompt", objective="kl_reward_grpo")
