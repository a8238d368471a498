"""AWM (docs/methods/awm.md): the weights, the loss's gradient by hand, the stratified steps and which samples
share them, the KL's weights and moving average, and a short run that resumes bit-exactly."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

from flowalign.checkpoint import load_checkpoint
from flowalign.ema import EMA
from flowalign.errors import UserError
from flowalign.sampling.sa_solver import SASolver
from flowalign.train import build_trainer
from flowalign.trainers.awm import (
    AWMConfig,
    AWMTrainer,
    advantage_weights,
    awm_loss,
    matching_log_prob,
    micro_batch_uniforms,
    sample_keys,
    stratified_steps,
    velocity_kl,
)
from flowalign.trainers.parts.policy_average import ramped_decay

from .conftest import small_config


def test_weights_are_the_clipped_advantages_rescaled_to_a_max():
    adv = torch.tensor([-7.0, -5.0, -1.0, 0.0, 2.5, 9.0])
    torch.testing.assert_close(advantage_weights(adv, 5.0, 1.0), torch.tensor([-1.0, -1.0, -0.2, 0.0, 0.5, 1.0]))
    torch.testing.assert_close(advantage_weights(adv, 5.0, 2.0), torch.tensor([-2.0, -2.0, -0.4, 0.0, 1.0, 2.0]))


def test_on_policy_gradient_is_the_advantage_weighted_flow_matching_gradient():
    """r = 1 exactly, and ∂L/∂v_i = Â_i·2(v_i − target_i)/(D·B) (uniform weighting); with β the KL's
    2β(v_i − v_ref,i)/(D·B) adds, with β_ema the moving average's 2β_ema(v_i − v_ema,i)/(D·B)."""
    g = torch.Generator().manual_seed(0)
    v, target, v_ref, v_ema = (torch.randn(3, 4, generator=g) for _ in range(4))
    w = torch.tensor([1.0, -0.5, 0.0])
    v = v.requires_grad_()
    lp = matching_log_prob(v, target, 0.7, "uniform", 0.25)
    kl, ema_kl = ((v - v_ref) ** 2).mean(1), ((v - v_ema) ** 2).mean(1)
    loss, info = awm_loss(lp, None, w, clip_range=1.0, kl=kl, beta=0.1, ema_kl=ema_kl, ema_beta=0.7)
    loss.backward()
    assert info["ratio"] == 1.0 and info["ema_kl"] == pytest.approx(ema_kl.mean().item())
    expected = (w[:, None] * 2 * (v - target) + 0.1 * 2 * (v - v_ref) + 0.7 * 2 * (v - v_ema)).detach() / (4 * 3)
    torch.testing.assert_close(v.grad, expected)


def test_ghuber_log_prob_matches_its_formula_and_clipping_stops_a_moved_ratio():
    mse = torch.tensor([0.16, 0.81])
    v = torch.stack([torch.full((4,), m.sqrt().item()) for m in mse])
    lp = matching_log_prob(v, torch.zeros(2, 4), 0.5, "ghuber", 0.5)
    torch.testing.assert_close(lp, -((mse + 1e-10) ** 0.5 - 1e-5) * 0.5 / 0.5)
    # r = e (> 1 + ε) with A > 0: the clipped branch is flat, no gradient
    log_prob = torch.tensor([1.0], requires_grad=True)
    awm_loss(log_prob, torch.tensor([0.0]), torch.tensor([1.0]), clip_range=0.2)[0].backward()
    assert log_prob.grad.item() == 0.0


def test_stratified_steps_take_one_step_per_stratum_and_never_step_zero():
    assert stratified_steps(14, 0.9, 6, torch.zeros(6)) == [1, 2, 4, 6, 8, 10]
    assert stratified_steps(14, 0.9, 6, torch.full((6,), 0.999)) == [1, 3, 5, 7, 9, 11]
    assert min(stratified_steps(4, 0.9, 3, torch.rand(3))) >= 1


def test_a_short_run_trains_and_resumes_bit_exactly(tmp_path, tiny_sd3_dir, prompt_file):
    """Two optimiser steps per batch: ℓ_old is taken under the sampling weights in the plan. The KL's moving
    average is saved with the weights and comes back on resume (a resumed run started it over otherwise)."""
    extra = ("trainer.name=awm", "trainer.train_timesteps=2", "trainer.updates_per_epoch=2",
             "trainer.batch_size=2", "run.checkpoint_every=1")
    first = build_trainer(small_config(tmp_path / "r", tiny_sd3_dir, prompt_file, *extra))
    before = [p.detach().clone() for p in first.params]
    first.train()
    assert any(not torch.equal(a, b) for a, b in zip(before, first.params))
    # after s = 2·2 optimiser steps φ = 0.004·φ_1 + 0.996·θ: neither the starting nor the trained weights
    assert any(not torch.equal(a, b) for a, b in zip(first.kl_ema.shadow, first.params))
    saved = load_checkpoint(tmp_path / "r" / "checkpoints" / "step-000002")["trainable"]
    names = first.trained_names()
    assert all(torch.equal(saved[f"behaviour.ema_kl.{n}"], s) for n, s in zip(names, first.kl_ema.shadow))
    resumed = build_trainer(small_config(tmp_path / "r", tiny_sd3_dir, prompt_file, *extra, "trainer.max_steps=3"))
    resumed.train()
    straight = build_trainer(small_config(tmp_path / "s", tiny_sd3_dir, prompt_file, *extra, "trainer.max_steps=3"))
    straight.train()
    assert all(torch.equal(a, b) for a, b in zip(resumed.params, straight.params))
    assert all(torch.equal(a, b) for a, b in zip(resumed.kl_ema.shadow, straight.kl_ema.shadow))


KNOWN = json.loads((Path(__file__).parent / "known_answers" / "awm_matching_loss.json").read_text())


@pytest.mark.parametrize("case", KNOWN["draws"],
                         ids=lambda c: "T{num_steps}-f{timestep_fraction}-n{train_timesteps}".format(**c))
def test_stratified_steps_equal_the_authors_draw(case):
    """main()'s 'discrete_wo_init' grid steps for the same uniforms (known_answers/)."""
    u = torch.tensor(case["rand_u"])
    steps = stratified_steps(case["num_steps"], case["timestep_fraction"], case["train_timesteps"], u)
    assert steps == case["t_indices"]


@pytest.mark.parametrize("case", KNOWN["cases"], ids=lambda c: f"{c['weighting']}-clip{c['clip_range']}")
def test_matching_log_prob_and_loss_equal_the_authors(case):
    """``compute_log_prob_awm`` and the 'exp_first' loss with the velocity-space KL on fixed float64 tensors
    (known_answers/): ℓ per re-noised copy, and the mean over copies of each unit's loss (one unit per copy)."""
    x0 = torch.tensor(KNOWN["clean_latents"], dtype=torch.float64)
    eps, v_old, v, v_ref = (torch.tensor(KNOWN[n], dtype=torch.float64)
                            for n in ("noise", "velocity_old", "velocity", "velocity_ref"))
    weighting = {"ghuber": "ghuber", "Uniform": "uniform"}[case["weighting"]]
    weights = advantage_weights(torch.tensor(KNOWN["advantages"], dtype=torch.float64), KNOWN["adv_clip_max"],
                                KNOWN["advantage_max"])
    b, total = len(x0), 0.0
    for s, k in enumerate(KNOWN["steps"]):
        rows, t = slice(s * b, (s + 1) * b), KNOWN["sigmas"][k]
        target = eps[rows] - x0
        log_prob = matching_log_prob(v[rows], target, t, weighting, KNOWN["ghuber_power"])
        old = matching_log_prob(v_old[rows], target, t, weighting, KNOWN["ghuber_power"])
        torch.testing.assert_close(log_prob, torch.tensor(case["log_prob"][s], dtype=torch.float64), rtol=1e-6, atol=0)
        torch.testing.assert_close(old, torch.tensor(case["old_log_prob"][s], dtype=torch.float64), rtol=1e-6, atol=0)
        kl = ((v[rows] - v_ref[rows]) ** 2).flatten(1).mean(1)
        loss, _ = awm_loss(log_prob, old, weights, case["clip_range"], kl, KNOWN["beta"])
        total += loss.item() / len(KNOWN["steps"])
    assert math.isclose(total, case["loss"], rel_tol=1e-6)


EMA_KNOWN = json.loads((Path(__file__).parent / "known_answers" / "awm_ema_kl.json").read_text())


def _kl_case(k: dict, case: dict) -> tuple:
    """A KL known answer's float64 tensors (clean latents, noise, the four velocities), its weighting's name
    and the advantage weights."""
    x0 = torch.tensor(k["clean_latents"], dtype=torch.float64)
    eps, v_old, v, v_ref, v_ema = (torch.tensor(k[n], dtype=torch.float64) for n in
                                   ("noise", "velocity_old", "velocity", "velocity_ref", "velocity_ema"))
    weighting = {"ghuber": "ghuber", "Uniform": "uniform"}[case["weighting"]]
    weights = advantage_weights(torch.tensor(k["advantages"], dtype=torch.float64), k["adv_clip_max"],
                                k["advantage_max"])
    return x0, eps, v_old, v, v_ref, v_ema, weighting, weights


@pytest.mark.parametrize("case", EMA_KNOWN["cases"],
                         ids=lambda c: f"{c['weighting']}-clip{c['clip_range']}-beta{c['beta']}-ema{c['ema_beta']}")
def test_loss_with_both_kl_terms_equals_the_authors(case):
    """The training loop's loss with β·KL to the starting weights and ema_beta·KL to the moving average
    ('Uniform' weights both) on fixed float64 tensors (known_answers/awm_ema_kl.json): the mean over the
    re-noised copies of ``awm_loss``, one unit per copy."""
    k = EMA_KNOWN
    x0, eps, v_old, v, v_ref, v_ema, weighting, weights = _kl_case(k, case)
    b, n, total, ema_total = len(x0), len(k["steps"]), 0.0, 0.0
    for s, step in enumerate(k["steps"]):
        rows, t = slice(s * b, (s + 1) * b), k["sigmas"][step]
        target = eps[rows] - x0
        log_prob = matching_log_prob(v[rows], target, t, weighting, k["ghuber_power"])
        old = matching_log_prob(v_old[rows], target, t, weighting, k["ghuber_power"])
        kl = ((v[rows] - v_ref[rows]) ** 2).flatten(1).mean(1)
        ema_kl = ((v[rows] - v_ema[rows]) ** 2).flatten(1).mean(1)
        loss, info = awm_loss(log_prob, old, weights, case["clip_range"], kl, case["beta"], ema_kl, case["ema_beta"])
        total += loss.item() / n
        ema_total += info.get("ema_kl", 0.0) / n
    assert math.isclose(total, case["loss"], rel_tol=1e-6)
    if "ema_kl_loss" in case:
        assert math.isclose(ema_total, case["ema_kl_loss"], rel_tol=1e-6)


@pytest.mark.parametrize("run", EMA_KNOWN["averages"], ids=lambda r: r["schedule"])
def test_kl_moving_average_equals_the_authors(run):
    """The 'ema' adapter's update after an epoch, ``φ ← d·φ + (1−d)·θ`` at the epoch's global step s
    (``d = min(0.3, 0.001·s)`` linear, 0.3 constant), over a sequence of policies crossing the cap
    (known_answers/awm_ema_kl.json)."""
    params = [torch.nn.Parameter(torch.tensor(t, dtype=torch.float64)) for t in EMA_KNOWN["average_start"]]
    average = EMA(params, run["cap"])
    for s, theta, decay, expected in zip(run["global_steps"], EMA_KNOWN["policy"], run["decays"], run["averages"]):
        with torch.no_grad():
            for p, t in zip(params, theta):
                p.copy_(torch.tensor(t, dtype=torch.float64))
        average.decay = ramped_decay(s, run["cap"], run["schedule"])
        assert math.isclose(average.decay, decay, rel_tol=1e-12)
        average.update()
        for got, want in zip(average.shadow, expected):
            torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), rtol=1e-6, atol=0)


@pytest.mark.parametrize(("step", "updates", "decay"), [(0, 1, 0.001), (1, 1, 0.002), (298, 1, 0.299), (299, 1, 0.3),
                                                         (0, 2, 0.002), (5000, 1, 0.3)])
def test_the_average_moves_after_a_batch_at_the_optimiser_steps_taken(step, updates, decay):
    """After training step ``step`` (0-based) s = (step + 1)·updates optimiser steps are taken: the authors'
    global_step after their epoch's one update, so the first batch moves φ with d = 0.001."""
    params = [torch.nn.Parameter(torch.zeros(3))]
    average = EMA(params, 0.3)
    with torch.no_grad():
        params[0].fill_(1.0)
    tcfg = AWMConfig(updates_per_epoch=updates)
    logs = AWMTrainer.finish(SimpleNamespace(kl_ema=average, step=step, tcfg=tcfg), None, [])
    assert logs["ema_kl_decay"] == pytest.approx(decay)
    torch.testing.assert_close(average.shadow[0], torch.full((3,), 1 - decay))


def test_the_average_is_a_copy_of_the_trained_tensors_only_when_weighted():
    cfg = SimpleNamespace(model=SimpleNamespace(finetune="lora"))
    assert [c.kind for c in AWMTrainer.weight_copies(cfg, AWMConfig())] == ["snapshot"]
    assert AWMTrainer.weight_copies(cfg, AWMConfig(ema_kl_beta=0)) == []
    full = SimpleNamespace(model=SimpleNamespace(finetune="full"))
    assert [c.kind for c in AWMTrainer.weight_copies(full, AWMConfig())] == ["reference", "snapshot"]


def test_a_run_saved_before_the_moving_average_resumes_only_as_it_was(tmp_path, tiny_sd3_dir, prompt_file):
    """A run of an earlier flowalign (no ``ema_kl_beta``: no moving-average KL) is refused under the new
    default with the line that continues it, and resumes with that line's setting."""
    extra = ("trainer.name=awm", "trainer.train_timesteps=2", "trainer.batch_size=2", "run.checkpoint_every=1")
    build_trainer(small_config(tmp_path / "r", tiny_sd3_dir, prompt_file, *extra, "trainer.ema_kl_beta=0",
                               "trainer.max_steps=1")).train()
    saved = tmp_path / "r" / "config.yaml"  # as the earlier flowalign wrote it: without the option
    config = yaml.safe_load(saved.read_text())
    del config["trainer"]["ema_kl_beta"]
    saved.write_text(yaml.safe_dump(config))
    with pytest.raises(UserError, match=r"saved before trainer.ema_kl_beta existed, which computed "
                                        r"trainer.ema_kl_beta=0.0; add trainer.ema_kl_beta=0.0 to continue it"):
        build_trainer(small_config(tmp_path / "r", tiny_sd3_dir, prompt_file, *extra, "trainer.max_steps=2"))
    resumed = build_trainer(small_config(tmp_path / "r", tiny_sd3_dir, prompt_file, *extra, "trainer.max_steps=2",
                                         "trainer.ema_kl_beta=0.0"))
    resumed.train()
    assert resumed.step == 2 and resumed.kl_ema is None


def test_rollouts_are_the_authors_sa_solver_and_the_endpoints_are_renoised_on_the_policys_grid(
        tmp_path, tiny_sd3_dir, prompt_file):
    """By default AWM samples as its authors do (SA-Solver, τ = rollout_noise_level) and re-noises on the
    policy's own grid, where their script takes its timesteps, not on the SA-Solver's moved grid."""
    extra = ("trainer.name=awm", "trainer.num_steps=6", "trainer.rollout_noise_level=0.7")
    trainer = build_trainer(small_config(tmp_path / "r", tiny_sd3_dir, prompt_file, *extra))
    assert trainer.sampler == SASolver(0.7)
    policy_grid = trainer.policy.sigmas(6).float()
    sa_grid = trainer.sampler.sigmas(trainer.policy.sigmas, 6)
    assert trainer.grid(6) == policy_grid.tolist()
    assert sa_grid[0] != policy_grid[0] and sa_grid[-2] != policy_grid[-2]
    # a chunk rolled out on the SA-Solver's grid is re-noised at the policy's σ, where the two grids differ too
    policy = trainer.policy
    chunk = SimpleNamespace(final_latents=torch.zeros(1, *policy.latent_shape), sigmas=sa_grid, num_steps=6,
                            cond=policy.encode(["a red circle"]), guidance_scale=1.0)
    for k in (0, 5):
        with torch.no_grad():
            _, _, t = trainer.velocity(SimpleNamespace(chunks=[chunk]), 0, k, torch.zeros(1, *policy.latent_shape))
        assert t == policy_grid[k].item() and t != sa_grid[k].item()
    euler = build_trainer(small_config(tmp_path / "e", tiny_sd3_dir, prompt_file, *extra,
                                       "trainer.rollout_solver=euler"))
    assert euler.sampler == "ode"


DRAW_KNOWN = json.loads((Path(__file__).parent / "known_answers" / "awm_step_draw.json").read_text())


@pytest.mark.parametrize("case", DRAW_KNOWN["cases"],
                         ids=lambda c: "N{samples}-b{micro_batch}-T{num_steps}-n{train_timesteps}".format(**c))
def test_samples_share_grid_steps_by_shuffled_micro_batch_as_the_authors(case):
    """main() shuffles the samples, cuts them into micro-batches of train.batch_size and draws the grid steps
    once per micro-batch (known_answers/awm_step_draw.json): for their permutation and their micro-batches'
    uniforms, :func:`micro_batch_uniforms` and :func:`stratified_steps` give every sample their steps."""
    perm, size = torch.tensor(case["perm"]), case["micro_batch"]
    u = torch.tensor([b["rand_u"] for b in case["micro_batches"]])
    for j, b in enumerate(case["micro_batches"]):  # their micro-batch j: the shuffled samples j·b … j·b + b − 1
        assert b["samples"] == case["perm"][j * size:(j + 1) * size]
    per_sample = micro_batch_uniforms(perm, size, u)
    steps = [stratified_steps(case["num_steps"], case["timestep_fraction"], case["train_timesteps"], row)
             for row in per_sample]
    assert steps == case["steps_by_sample"]


def test_a_short_last_micro_batch_takes_the_last_draw():
    """When the micro-batch size does not divide the samples (their reshape refuses it), the last micro-batch
    holds the remainder."""
    u = torch.arange(6.0).view(3, 2)
    got = micro_batch_uniforms(torch.tensor([4, 0, 2, 1, 3]), 2, u)
    torch.testing.assert_close(got, torch.tensor([[0.0, 1], [2, 3], [2, 3], [4, 5], [0, 1]]))


@pytest.mark.parametrize("draw", ["micro_batch", "rollout_batch"])
def test_the_plan_draws_grid_steps_per_shuffled_micro_batch_across_rollout_batches(tmp_path, tiny_sd3_dir,
                                                                                   prompt_file, draw):
    """``step_draw: micro_batch``: each sample trains at the steps of its micro-batch's draw, the step's samples
    (all rollout batches, sorted by identity) shuffled into micro-batches of ``step_draw_size``; the draw
    reads only the samples' identities and the step, so any rank layout (any rollout batches) draws the same.
    ``rollout_batch`` (the former form): one draw per rollout batch."""
    extra = ("trainer.name=awm", "trainer.num_steps=12", "trainer.train_timesteps=3", "trainer.batch_size=2",
             "trainer.step_draw_size=3", f"trainer.step_draw={draw}")
    trainer = build_trainer(small_config(tmp_path / "r", tiny_sd3_dir, prompt_file, *extra))
    batch = trainer.collect(0)
    batch.advantages = torch.linspace(-1, 1, len(batch.groups))  # every rollout batch trained
    plan = trainer.plan(batch, torch.Generator().manual_seed(0))
    keys = batch.per_chunk(torch.tensor(sample_keys(batch)))
    got: dict[tuple[int, int], list[int]] = {}
    for unit in plan.steps[0]:
        for key, k in zip(keys[unit.chunk].tolist(), unit.k, strict=True):
            got.setdefault(tuple(key), []).append(k)
    assert len(got) == len(batch.groups) == 8 and len(batch.chunks) == 4
    if draw == "rollout_batch":
        for chunk_keys in keys:
            assert len({tuple(got[tuple(k)]) for k in chunk_keys.tolist()}) == 1
        return
    shared = trainer.micro_batch_draw(sorted(got), 0)
    for key, steps in got.items():
        assert steps == stratified_steps(12, 0.9, 3, shared[key])
    # 8 samples in micro-batches of 3: three draws, shared by 3, 3 and 2 samples
    sizes = sorted(sum(torch.equal(u, v) for v in shared.values()) for u in shared.values())
    assert sizes == [2, 2, 3, 3, 3, 3, 3, 3]
    assert len({tuple(s) for s in got.values()}) > 1


ELBO_KNOWN = json.loads((Path(__file__).parent / "known_answers" / "awm_elbo_kl.json").read_text())


@pytest.mark.parametrize("case", ELBO_KNOWN["cases"],
                         ids=lambda c: f"{c['kl_weight']}-{c['kl_ema_weight']}-{c['weighting']}-clip{c['clip_range']}")
def test_kl_weights_and_loss_equal_the_authors(case):
    """Their 'ELBO' KL weight 1/(2·std_dev_t²) (``kl_weight``, ``kl_ema_weight``) and 'Uniform', in the loss
    with both KL terms (known_answers/awm_elbo_kl.json): the mean over re-noised copies of ``awm_loss``."""
    k = ELBO_KNOWN
    x0, eps, v_old, v, v_ref, v_ema, weighting, weights = _kl_case(k, case)
    b, n = k["b"], k["n"]
    total, kl_total, ema_total = 0.0, 0.0, 0.0
    for s, t in enumerate(k["sigmas"]):
        rows, target = slice(s * b, (s + 1) * b), eps[s * b:(s + 1) * b] - x0
        log_prob = matching_log_prob(v[rows], target, t, weighting, k["ghuber_power"])
        old = matching_log_prob(v_old[rows], target, t, weighting, k["ghuber_power"])
        per_sample_t = torch.full((b,), t)  # one level per sample, as a micro-batch draw hands it
        kl = velocity_kl(v[rows], v_ref[rows], per_sample_t, case["kl_weight"].lower())
        ema_kl = velocity_kl(v[rows], v_ema[rows], t, case["kl_ema_weight"].lower())
        loss, info = awm_loss(log_prob, old, weights, case["clip_range"], kl, case["beta"], ema_kl, case["ema_beta"])
        total, kl_total, ema_total = total + loss.item() / n, kl_total + info["kl"] / n, ema_total + info["ema_kl"] / n
    assert math.isclose(total, case["loss"], rel_tol=1e-6)
    assert math.isclose(kl_total, case["kl_loss"], rel_tol=1e-6)
    assert math.isclose(ema_total, case["ema_kl_loss"], rel_tol=1e-6)


def test_the_moving_average_kl_is_weighed_whatever_beta_their_script_needs_both_weights():
    """Their loss block weighs the moving-average KL inside ``if beta > 0``, but with β = 0 (or ema_beta = 0)
    it stops before any loss (known_answers/awm_elbo_kl.json: the NameErrors of lines 1286 and 1289): every run
    of theirs weighs both terms, as here; β = 0 here keeps the moving-average term."""
    assert ELBO_KNOWN["beta_zero"]["raises"] == "NameError: name 'log_prob_ref' is not defined"
    assert ELBO_KNOWN["ema_beta_zero"]["raises"] == "NameError: name 'model_output_ema' is not defined"
    lp, ema_kl = torch.tensor([-0.5, -0.25]), torch.tensor([0.2, 0.4])
    loss, info = awm_loss(lp, None, torch.tensor([1.0, -1.0]), 1.0, torch.tensor([9.0, 9.0]), 0.0, ema_kl, 1.0)
    assert "kl" not in info and info["ema_kl"] == pytest.approx(0.3)
    assert loss.item() == pytest.approx(0.0 + 0.3)  # on-policy r = 1: mean −Â = 0, plus β_ema·mean ema_kl


def test_the_former_draw_and_kl_weights_stay_settable():
    """Runs saved before ``step_draw`` existed drew one set of grid steps per rollout batch; the KL weights
    default to the 'Uniform' of every recipe of theirs."""
    assert AWMConfig.before["step_draw"] == "rollout_batch"
    config = AWMConfig()
    assert (config.step_draw, config.step_draw_size, config.kl_weight, config.ema_kl_weight) == (
        "micro_batch", 3, "uniform", "uniform")


def test_a_rollout_batch_without_advantage_trains_its_kl_terms_as_the_authors_loop(tmp_path, tiny_sd3_dir,
                                                                                    prompt_file):
    """``zero_advantage: kept`` (theirs: the filter of zero-advantage samples is commented out): a rollout batch
    whose advantages are all 0 is planned like the others, so its samples' KL terms train and count in the
    mean; ``skipped`` (the former form, as saved runs and the tiny recipe) leaves it out."""
    extra = ("trainer.name=awm", "trainer.num_steps=6", "trainer.train_timesteps=2", "trainer.batch_size=2")
    trainer = build_trainer(small_config(tmp_path / "r", tiny_sd3_dir, prompt_file, *extra))
    assert trainer.tcfg.zero_advantage == "kept" and AWMConfig.before["zero_advantage"] == "skipped"
    batch = trainer.collect(0)
    advantages = torch.zeros(len(batch.groups))
    advantages[0] = 1.0  # only the first rollout batch has an advantage
    batch.advantages = advantages
    planned = {u.chunk for step in trainer.plan(batch, torch.Generator().manual_seed(0)).steps for u in step}
    assert planned == set(range(len(batch.chunks))) and len(batch.chunks) > 1
    unit = next(u for step in trainer.plan(batch, torch.Generator().manual_seed(0)).steps for u in step if u.chunk)
    loss, _ = trainer.loss(batch, unit)
    assert torch.isfinite(loss)
    trainer.tcfg = trainer.tcfg.model_copy(update={"zero_advantage": "skipped"})
    skipped = {u.chunk for step in trainer.plan(batch, torch.Generator().manual_seed(0)).steps for u in step}
    assert skipped == {0}
