"""Diffusion-DPO (docs/methods/diffusion_dpo.md): the reference term at θ = θ_ref (log 2, half the plain
DPO direction), the loss's gradient by hand, pair selection, offline pairs from a JSONL, and a short online
run that resumes bit-exactly; the loss and its gradient equal Flow-Factory's DPO trainer
(known_answers/diffusion_dpo_loss.json), and so do its timestep of a micro-batch of pairs and its logged
implicit accuracy (known_answers/diffusion_dpo_timesteps.json)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from flowalign.errors import UserError
from flowalign.train import build_trainer
from flowalign.trainers.base import derived_seed
from flowalign.trainers.diffusion_dpo import (DiffusionDPOConfig, best_and_worst, diffusion_dpo_loss, dpo_timesteps,
                                              micro_batch_units, shared_timestep)
from flowalign.trainers.parts.reductions import per_sample_mean
from flowalign.trainers.parts.timesteps import pair_timesteps

from .conftest import small_config

KNOWN = json.loads((Path(__file__).parent / "known_answers" / "diffusion_dpo_loss.json").read_text())
TIMESTEPS = json.loads((Path(__file__).parent / "known_answers" / "diffusion_dpo_timesteps.json").read_text())


@pytest.mark.parametrize("case", KNOWN["cases"], ids=lambda c: f"beta{c['beta']}")
def test_loss_and_gradient_equal_flow_factorys_dpo_trainer(case):
    """Flow-Factory's ``DPOTrainer.optimize`` for one timestep: per-sample velocity MSE to ``noise − x0`` of
    the policy and the reference on the chosen and rejected latents, ``−log σ(−β/2·Δ)`` averaged over the
    pairs (the trainer's ``sum / total`` on one rank); the gradient in the policy's predictions too."""
    f64 = lambda k: torch.tensor(KNOWN[k], dtype=torch.float64)
    x_w, x_l, noise = f64("chosen_latents"), f64("rejected_latents"), f64("noise")
    pred_w, pred_l = f64("theta_w_pred").requires_grad_(True), f64("theta_l_pred").requires_grad_(True)
    err = lambda pred, x0: per_sample_mean((pred - (noise - x0)) ** 2)
    err_w, err_l = err(pred_w, x_w), err(pred_l, x_l)
    ref_w, ref_l = err(f64("ref_w_pred"), x_w), err(f64("ref_l_pred"), x_l)
    for mine, key in ((err_w, "theta_w_err"), (err_l, "theta_l_err"), (ref_w, "ref_w_err"), (ref_l, "ref_l_err")):
        torch.testing.assert_close(mine, torch.tensor(case[key], dtype=torch.float64), rtol=1e-6, atol=0)
    per_pair, info = diffusion_dpo_loss(err_w, err_l, ref_w, ref_l, case["beta"])
    loss = per_pair.sum() / len(per_pair)
    loss.backward()
    torch.testing.assert_close(loss.item(), case["loss"], rtol=1e-6, atol=0)
    torch.testing.assert_close(info["margin"].item(), sum(case["inside_term"]) / len(case["inside_term"]), rtol=1e-6, atol=0)
    assert info["implicit_acc"] == case["implicit_accuracy"]
    for pred, key in ((pred_w, "grad_theta_w_pred"), (pred_l, "grad_theta_l_pred")):
        torch.testing.assert_close(pred.grad, torch.tensor(case[key], dtype=torch.float64), rtol=1e-6, atol=1e-15)


def test_at_the_reference_the_loss_is_log_2_and_its_gradient_half_the_plain_direction():
    g = torch.Generator().manual_seed(0)
    err_w, err_l = torch.rand(4, generator=g, requires_grad=True), torch.rand(4, generator=g, requires_grad=True)
    beta = 10.0
    loss, info = diffusion_dpo_loss(err_w, err_l, err_w.detach(), err_l.detach(), beta)
    assert torch.allclose(loss, torch.full((4,), math.log(2)))
    assert info["implicit_acc"] == 0  # every pair ties: none counts (Flow-Factory's implicit_accuracy)
    loss.sum().backward()
    # plain direction: ∇ of β/2·(e_w − e_l); σ(0) = ½ of it
    assert torch.equal(err_w.grad, torch.full((4,), 0.5 * beta / 2))
    assert torch.equal(err_l.grad, torch.full((4,), -0.5 * beta / 2))


@pytest.mark.parametrize("case", TIMESTEPS["timestep_cases"],
                         ids=lambda c: f"{c['weighting_scheme']}{c['unit_draw']}-range{c['timestep_range']}-{c['pairs']}pairs")
def test_shared_timestep_equals_flow_factorys_dpo_trainer(case, monkeypatch):
    """Flow-Factory's ``_sample_timesteps`` → ``flow_match_sigma`` for one micro-batch, its one random draw fixed:
    every pair gets the same σ. flowalign's ``dpo_timesteps`` (``timestep_draw: shared``) draws one unit per
    pair from the pairs' own generators; with the first pair's draw replaced by theirs and every other pair's
    by another value, every pair's t must be their σ (the formula, and one t per micro-batch from its first pair)."""
    uniform = case["weighting_scheme"] == "uniform"
    calls = []

    def fixed(*shape, generator=None, **kw):  # call k of the micro-batch: theirs for the first pair, others after
        k = len(calls)
        calls.append(k)
        value = (case["unit_draw"] + 0.29 * k) % 1.0 if uniform else case["unit_draw"] + 0.37 * k
        return torch.full(shape, value, dtype=torch.float32)

    gens = [torch.Generator().manual_seed(i) for i in range(case["pairs"])]
    monkeypatch.setattr(torch, "rand" if uniform else "randn", fixed)
    t = dpo_timesteps(gens, case["weighting_scheme"], "shared", case["timestep_range"])
    monkeypatch.undo()
    assert len(calls) == case["pairs"]  # one unit draw from each pair's generator: its ε after it is unchanged
    torch.testing.assert_close(t, torch.tensor(case["sigma"], dtype=torch.float32), rtol=0, atol=1e-6)
    mine = shared_timestep(torch.tensor([case["unit_draw"]]), case["weighting_scheme"], case["timestep_range"])
    torch.testing.assert_close(1000 * mine, torch.tensor(case["t_scheduler"][:1]), rtol=0, atol=1e-3)


@pytest.mark.parametrize("sampling", ["logit_normal", "uniform"])
def test_per_pair_is_the_former_draw_and_leaves_each_pairs_noise_as_the_shared_draw_does(sampling):
    """``timestep_draw: per_pair`` is the former t, each pair's own :func:`pair_timesteps`; either draw takes one
    number from each pair's generator, so the ε drawn after it is the same under both."""
    seeds = [11, 12, 13]
    fresh = lambda: [torch.Generator().manual_seed(s) for s in seeds]
    former = torch.cat([pair_timesteps(1, sampling, g) for g in fresh()])
    gens = fresh()
    assert torch.equal(dpo_timesteps(gens, sampling, "per_pair", 0.99), former)
    eps_per_pair = [torch.randn(2, 3, generator=g) for g in gens]
    gens = fresh()
    shared = dpo_timesteps(gens, sampling, "shared", 0.99)
    assert torch.equal(shared, shared[:1].expand(3)) and not torch.equal(shared, former)
    assert all(torch.equal(torch.randn(2, 3, generator=g), e) for g, e in zip(gens, eps_per_pair))


def test_options_default_to_flow_factorys_draw_and_saved_runs_resume_with_the_former():
    cfg = DiffusionDPOConfig()
    assert (cfg.timestep_draw, cfg.timestep_range) == ("shared", 0.99)
    assert DiffusionDPOConfig.before == {"timestep_draw": "per_pair", "tied_groups": "dropped",
                                         "noise_draw": "per_step", "epoch_order": "in_order"}
    assert cfg.epoch_order == "shuffled" and DiffusionDPOConfig.before_when["epoch_order"] == ("timestep_draw",
                                                                                               ("shared",))


@pytest.mark.parametrize("case", TIMESTEPS["accuracy_cases"], ids=lambda c: f"beta{c['beta']}")
def test_implicit_accuracy_equals_flow_factorys_a_tie_counting_0(case):
    """Flow-Factory's ``implicit_accuracy`` (chosen's implicit reward strictly above the rejected's) and loss."""
    f64 = lambda k: torch.tensor(case[k], dtype=torch.float64)
    per_pair, info = diffusion_dpo_loss(f64("theta_w_err"), f64("theta_l_err"), f64("ref_w_err"), f64("ref_l_err"),
                                        case["beta"])
    assert info["implicit_acc"].item() == pytest.approx(case["implicit_accuracy"], abs=1e-7)
    assert per_pair.mean().item() == pytest.approx(case["loss"], rel=1e-12)
    assert info["margin"].item() == pytest.approx(float(f64("inside_term").mean()), rel=1e-12, abs=1e-12)


def test_gradient_by_hand_away_from_the_reference():
    """∂L/∂e_w = σ(β/2·Δ)·β/2 with Δ = (e_w − r_w) − (e_l − r_l)."""
    err_w, err_l = torch.tensor([0.3], requires_grad=True), torch.tensor([0.2], requires_grad=True)
    ref_w, ref_l, beta = torch.tensor([0.25]), torch.tensor([0.25]), 20.0
    loss, _ = diffusion_dpo_loss(err_w, err_l, ref_w, ref_l, beta)
    loss.sum().backward()
    delta = (0.3 - 0.25) - (0.2 - 0.25)
    assert loss.item() == pytest.approx(math.log1p(math.exp(beta / 2 * delta)), rel=1e-6)
    weight = 1 / (1 + math.exp(-beta / 2 * delta))
    assert err_w.grad.item() == pytest.approx(weight * beta / 2, rel=1e-6)
    assert err_l.grad.item() == pytest.approx(-weight * beta / 2, rel=1e-6)


def test_online_pairs_are_each_groups_best_and_worst_valid_sample():
    rewards = torch.tensor([0.2, 0.9, 0.1, 5.0])
    valid = torch.tensor([True, True, True, False])
    assert best_and_worst(rewards, valid) == (1, 2)
    assert best_and_worst(torch.ones(3), torch.ones(3, dtype=torch.bool)) is None  # a tie prefers nothing


def _pairs(tmp_path, n: int = 2) -> str:
    rng = np.random.default_rng(0)
    rows = []
    for i, prompt in enumerate(["a red circle", "a blue square", "a green star", "a yellow triangle"] * (n // 4 + 1)):
        if i == n:
            break
        for kind in ("chosen", "rejected"):
            Image.fromarray(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)).save(tmp_path / f"{kind}{i}.png")
        rows.append({"prompt": prompt, "chosen": f"chosen{i}.png", "rejected": f"rejected{i}.png"})
    (tmp_path / "prefs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(tmp_path / "prefs.jsonl")


@pytest.mark.parametrize("finetune", ["lora", "full"])
def test_offline_pairs_start_at_log_2_against_the_reference(tmp_path, tiny_sd3_dir, prompt_file, finetune):
    """θ = θ_ref at the start (adapter off, or the frozen copy): every pair's loss is log 2; the step moves θ."""
    t = build_trainer(small_config(tmp_path / finetune, tiny_sd3_dir, prompt_file, "trainer.name=diffusion_dpo",
                                   f"trainer.pairs={_pairs(tmp_path)}", "rewards=[]", f"model.finetune={finetune}",
                                   "trainer.max_steps=1"))
    before = [p.detach().clone() for p in t.params]
    logs = t.train_step()
    assert logs["train/dpo_loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert logs["train/pairs"] == 2
    assert any(not torch.equal(a, b) for a, b in zip(before, t.params))


@pytest.mark.parametrize("draw", ["shared", "per_pair"])
def test_a_micro_batch_of_pairs_shares_one_t_by_default_and_the_former_form_keeps_one_per_pair(
        tmp_path, tiny_sd3_dir, prompt_file, draw):
    """The plan's units: ``shared`` gives both pairs of a micro-batch one t, at least 1 − timestep_range;
    ``per_pair`` gives each its own; the ε are the same either way."""
    t = build_trainer(small_config(tmp_path, tiny_sd3_dir, prompt_file, "trainer.name=diffusion_dpo",
                                   f"trainer.pairs={_pairs(tmp_path)}", "rewards=[]", "trainer.prompts_per_step=2",
                                   "trainer.batch_size=2", f"trainer.timestep_draw={draw}"))
    batch = t.collect(0)
    (unit,) = t.plan(batch, torch.Generator().manual_seed(0)).steps[0]
    gens = [torch.Generator().manual_seed(s) for s in batch.seeds]
    assert torch.equal(unit.t, dpo_timesteps(gens, "logit_normal", draw, 0.99))
    assert torch.equal(unit.eps, torch.stack([torch.randn(batch.x_w.shape[1:], generator=g) for g in gens]))
    assert (unit.t[0] == unit.t[1]) == (draw == "shared")
    if draw == "shared":
        assert 0.01 <= float(unit.t[0]) <= 0.9901


def epoch_pairs(t, batch) -> list[list[tuple[int, ...]]]:
    """Each inner epoch's (optimiser step's) units as their pairs, every pair once an epoch."""
    steps = [[u.index for u in units] for units in t.plan(batch, torch.Generator().manual_seed(0)).steps]
    assert all(sorted(i for index in units for i in index) == list(range(len(batch.seeds))) for units in steps)
    return steps


def same_units(a, b) -> bool:
    return len(a) == len(b) and all(u.index == v.index and torch.equal(u.t, v.t) and torch.equal(u.eps, v.eps)
                                    and torch.equal(u.ref_w, v.ref_w) for u, v in zip(a, b))


def test_each_inner_epoch_reshuffles_the_pairs_and_draws_their_t_and_noise_afresh(tmp_path, tiny_sd3_dir,
                                                                                  prompt_file):
    """The default (``noise_draw: per_inner_epoch``): inner epoch e ≥ 1 places the step's pairs in an order of their
    positions permuted by a generator keyed by (seed, step, e), micro-batches of 2 places sharing a t, and every
    pair draws its t and ε from a generator keyed by (seed, step, position, e). ``per_step`` (the former form, as
    saved runs computed) trains epoch 0's units again in every epoch; with one inner epoch the two plan alike.
    (Epoch 0 in the step's order here, ``epoch_order: in_order``: its shuffle is the next test's.)"""
    common = ("trainer.name=diffusion_dpo", f"trainer.pairs={_pairs(tmp_path, 6)}", "rewards=[]",
              "trainer.prompts_per_step=6", "trainer.batch_size=2", "trainer.inner_epochs=3",
              "trainer.epoch_order=in_order")
    t = build_trainer(small_config(tmp_path / "s", tiny_sd3_dir, prompt_file, *common))
    former = build_trainer(small_config(tmp_path / "o", tiny_sd3_dir, prompt_file, *common,
                                        "trainer.noise_draw=per_step"))
    assert t.tcfg.noise_draw == "per_inner_epoch" and DiffusionDPOConfig.before_when["noise_draw"][0] == "inner_epochs"
    assert 1 not in DiffusionDPOConfig.before_when["noise_draw"][1]
    batch = t.collect(1)
    assert batch.positions == list(range(6)) and batch.step == 1
    plan = t.plan(batch, torch.Generator().manual_seed(0))
    epochs = epoch_pairs(t, batch)
    assert epochs[0] == [(0, 1), (2, 3), (4, 5)]
    shape = batch.x_w.shape[1:]
    for e in (1, 2):
        order = torch.randperm(6, generator=torch.Generator().manual_seed(derived_seed(0, 1, e, 53))).tolist()
        assert epochs[e] == [tuple(order[i : i + 2]) for i in range(0, 6, 2)]
        for unit in plan.steps[e]:
            gens = [torch.Generator().manual_seed(derived_seed(0, 1, k, 47, e)) for k in unit.index]
            first = torch.Generator().manual_seed(derived_seed(0, 1, unit.index[0], 47, e))
            shared = shared_timestep(torch.randn(1, generator=first), "logit_normal", 0.99)
            assert torch.equal(unit.t, shared.expand(2))
            for g in gens:
                torch.randn(1, generator=g)  # the pair's unit draw, before its ε
            assert torch.equal(unit.eps, torch.stack([torch.randn(shape, generator=g) for g in gens]))
    eps = [{k: unit.eps[j] for unit in units for j, k in enumerate(unit.index)} for units in plan.steps]
    assert all(not torch.equal(eps[0][k], eps[e][k]) for e in (1, 2) for k in range(6))
    assert len({float(u.t[0]) for units in plan.steps for u in units}) == 9  # a t per micro-batch and epoch
    kept = former.plan(batch, torch.Generator().manual_seed(0)).steps
    assert [units is kept[0] for units in kept] == [True] * 3  # the former form: epoch 0's units again
    assert same_units(kept[0], plan.steps[0])
    one = build_trainer(small_config(tmp_path / "one", tiny_sd3_dir, prompt_file, *common, "trainer.inner_epochs=1"))
    (units,) = one.plan(batch, torch.Generator().manual_seed(0)).steps
    assert same_units(units, plan.steps[0])


def test_the_first_inner_epoch_is_shuffled_too_as_flow_factorys(tmp_path, tiny_sd3_dir, prompt_file):
    """Flow-Factory's loop permutes the pairs at every inner epoch, the first included (dpo.py l. 504-515): by
    default (``epoch_order: shuffled``) epoch 0's micro-batches are cut from the positions permuted by a generator
    keyed by (seed, step, 0), the shared t drawn by the pair at each micro-batch's first place, each pair's ε its
    own (as in order); ``in_order`` (the former form) cuts them in the step's order."""
    common = ("trainer.name=diffusion_dpo", f"trainer.pairs={_pairs(tmp_path, 6)}", "rewards=[]",
              "trainer.prompts_per_step=6", "trainer.batch_size=2")
    t = build_trainer(small_config(tmp_path / "s", tiny_sd3_dir, prompt_file, *common))
    former = build_trainer(small_config(tmp_path / "o", tiny_sd3_dir, prompt_file, *common,
                                        "trainer.epoch_order=in_order"))
    batch = t.collect(1)
    (units,) = t.plan(batch, torch.Generator().manual_seed(0)).steps
    (kept,) = former.plan(batch, torch.Generator().manual_seed(0)).steps
    order = torch.randperm(6, generator=torch.Generator().manual_seed(derived_seed(0, 1, 0, 53))).tolist()
    assert [u.index for u in units] == [tuple(order[i : i + 2]) for i in range(0, 6, 2)] != [u.index for u in kept]
    assert [u.index for u in kept] == [(0, 1), (2, 3), (4, 5)]
    eps = lambda us: {k: u.eps[j] for u in us for j, k in enumerate(u.index)}
    assert all(torch.equal(eps(units)[k], eps(kept)[k]) for k in range(6))  # each pair's own draw, either way
    for unit in units:
        first = torch.Generator().manual_seed(derived_seed(0, 1, unit.index[0], 47))
        assert torch.equal(unit.t, shared_timestep(torch.randn(1, generator=first), "logit_normal", 0.99).expand(2))


def test_the_reshuffled_pairs_are_flow_factorys(tmp_path, tiny_sd3_dir, prompt_file):
    """Known answer: Flow-Factory's inner-epoch shuffle (dpo.py @ a0b2bc5, ``DPOTrainer.optimize`` l. 504-515:
    ``perm = torch.randperm(len(pairs), generator=perm_gen)``, ``shuffled_pairs = [pairs[i] for i in perm]``, cut
    into per_device_batch_size pair batches) on 6 pairs, batches of 2, with the generator flowalign keys for seed
    0, step 1 and inner epoch e (derived_seed(0, 1, e, 53)) as their perm_gen, gave these pair batches for inner
    epochs 1 and 2. The plan's micro-batches equal them (one process: the pairs' positions are their indices);
    its epoch 0 keeps the step's order (a random draw of pairs already), as before."""
    flow_factory = {1: [[5, 4], [0, 3], [2, 1]], 2: [[5, 1], [4, 0], [3, 2]]}
    t = build_trainer(small_config(tmp_path, tiny_sd3_dir, prompt_file, "trainer.name=diffusion_dpo",
                                   f"trainer.pairs={_pairs(tmp_path, 6)}", "rewards=[]", "trainer.prompts_per_step=6",
                                   "trainer.batch_size=2", "trainer.inner_epochs=3"))
    assert t.cfg.run.seed == 0
    epochs = epoch_pairs(t, t.collect(1))
    assert [[list(index) for index in epochs[e]] for e in (1, 2)] == [flow_factory[1], flow_factory[2]]


@pytest.mark.parametrize("inner_epochs", [1, 2])
def test_online_run_trains_and_resumes_bit_exactly(tmp_path, tiny_sd3_dir, prompt_file, inner_epochs):
    extra = ("trainer.name=diffusion_dpo", "trainer.dpo_beta=200", "run.checkpoint_every=1",
             f"trainer.inner_epochs={inner_epochs}", *(("trainer.batch_size=1",) if inner_epochs > 1 else ()))
    first = build_trainer(small_config(tmp_path / "r", tiny_sd3_dir, prompt_file, *extra))
    before = [p.detach().clone() for p in first.params]
    first.train()
    assert any(not torch.equal(a, b) for a, b in zip(before, first.params))
    resumed = build_trainer(small_config(tmp_path / "r", tiny_sd3_dir, prompt_file, *extra, "trainer.max_steps=3"))
    resumed.train()
    straight = build_trainer(small_config(tmp_path / "s", tiny_sd3_dir, prompt_file, *extra, "trainer.max_steps=3"))
    straight.train()
    assert all(torch.equal(a, b) for a, b in zip(resumed.params, straight.params))


@pytest.mark.parametrize("sampling", ["logit_normal", "uniform"])
def test_a_micro_batchs_shared_draw_is_the_same_whichever_rank_holds_its_pairs(sampling):
    """Micro-batches of 2 consecutive global positions: a rank holding positions 1 and 2 gives each the draw of
    its micro-batch as one process holding 0-3 does; a micro-batch wholly here draws what its first pair's own
    generator draws first (so one process computes Flow-Factory's first-pair form)."""
    key = lambda k: 1000 + k
    everything = micro_batch_units([0, 1, 2, 3], 2, sampling, key)
    assert everything[0] == everything[1] and everything[2] == everything[3] and everything[1] != everything[2]
    torch.testing.assert_close(micro_batch_units([1, 2], 2, sampling, key), everything[1:3], rtol=0, atol=0)
    first = torch.Generator().manual_seed(key(2))
    own = torch.rand(1, generator=first) if sampling == "uniform" else torch.randn(1, generator=first)
    assert torch.equal(everything[2:3], own)


def test_a_tied_group_pairs_its_first_sample_with_itself_as_flow_factory(tmp_path, tiny_sd3_dir, prompt_file):
    """The default ``tied_groups: self_pair``: a group whose rewards all tie gives Flow-Factory's argmax / argmin
    pair, its first sample twice: the pair counts among the step's pairs, its loss is log 2 with a zero
    gradient and its implicit accuracy 0 (a tie)."""
    t = build_trainer(small_config(tmp_path, tiny_sd3_dir, prompt_file, "trainer.name=diffusion_dpo",
                                   "rewards=[{name: 'tests.flowalign.trainers.toy_rewards:constant'}]"))
    assert t.tcfg.tied_groups == "self_pair" and DiffusionDPOConfig.before["tied_groups"] == "dropped"
    batch = t.collect(0)
    assert len(batch.seeds) == t.tcfg.prompts_per_step and batch.logs["train/pairs"] == t.tcfg.prompts_per_step
    assert torch.equal(batch.x_w, batch.x_l)
    units = [u for step in t.plan(batch, torch.Generator().manual_seed(0)).steps for u in step]
    assert units
    for unit in units:
        loss, info = t.loss(batch, unit)
        loss.backward()
        assert info["dpo_loss"] == pytest.approx(math.log(2)) and info["implicit_acc"] == 0
    # the two halves of a self pair cancel, up to float32 rounding (times β / 2) of their summed gradients:
    # a thousandth of what the same pairs give once their rejected images differ
    tied = max(p.grad.abs().max().item() for p in t.params if p.grad is not None)
    t.optimizer.zero_grad()
    batch.x_l = batch.x_l.roll(1, dims=0)
    for unit in (u for step in t.plan(batch, torch.Generator().manual_seed(0)).steps for u in step):
        t.loss(batch, unit)[0].backward()
    assert tied < 1e-3 * max(p.grad.abs().max().item() for p in t.params if p.grad is not None)
    assert best_and_worst(torch.tensor([0.3, 0.3, 0.3]), torch.tensor([False, True, True]), "self_pair") == (1, 1)
    assert best_and_worst(torch.tensor([0.3, 0.3]), torch.tensor([True, False]), "self_pair") is None


def test_a_step_whose_groups_all_tie_has_no_pair_and_trains_nothing(tmp_path, tiny_sd3_dir, prompt_file):
    """``tied_groups: dropped`` (the former form) under a reward that ties every group: no pair, an empty plan
    under the shared draw (a run stopped here once), and the weights stay."""
    t = build_trainer(small_config(tmp_path, tiny_sd3_dir, prompt_file, "trainer.name=diffusion_dpo",
                                   "trainer.tied_groups=dropped",
                                   "rewards=[{name: 'tests.flowalign.trainers.toy_rewards:constant'}]"))
    assert t.tcfg.timestep_draw == "shared"
    batch = t.collect(0)
    assert len(batch.seeds) == 0 and batch.positions == []
    assert t.plan(batch, torch.Generator().manual_seed(0)).steps == []
    before = [p.detach().clone() for p in t.params]
    t.update(batch, torch.Generator().manual_seed(0))
    assert all(torch.equal(a, b) for a, b in zip(before, t.params))
