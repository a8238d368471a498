"""Diffusion-DPO (docs/methods/diffusion_dpo.md): the reference term at θ = θ_ref (log 2, half the plain
DPO direction), the loss's gradient by hand, pair selection, offline pairs from a JSONL, and a short online
run that resumes bit-exactly; the loss and its gradient equal Flow-Factory's DPO trainer
(known_answers/diffusion_dpo_loss.json)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from flowalign.train import build_trainer
from flowalign.trainers.diffusion_dpo import best_and_worst, diffusion_dpo_loss
from flowalign.trainers.parts.reductions import per_sample_mean

from .conftest import small_config

KNOWN = json.loads((Path(__file__).parent / "known_answers" / "diffusion_dpo_loss.json").read_text())


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
    assert info["implicit_acc"] == 0.5
    loss.sum().backward()
    # plain direction: ∇ of β/2·(e_w − e_l); σ(0) = ½ of it
    assert torch.equal(err_w.grad, torch.full((4,), 0.5 * beta / 2))
    assert torch.equal(err_l.grad, torch.full((4,), -0.5 * beta / 2))


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


def _pairs(tmp_path) -> str:
    rng = np.random.default_rng(0)
    rows = []
    for i, prompt in enumerate(["a red circle", "a blue square"]):
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


def test_online_run_trains_and_resumes_bit_exactly(tmp_path, tiny_sd3_dir, prompt_file):
    extra = ("trainer.name=diffusion_dpo", "trainer.dpo_beta=200", "run.checkpoint_every=1")
    first = build_trainer(small_config(tmp_path / "r", tiny_sd3_dir, prompt_file, *extra))
    before = [p.detach().clone() for p in first.params]
    first.train()
    assert any(not torch.equal(a, b) for a, b in zip(before, first.params))
    resumed = build_trainer(small_config(tmp_path / "r", tiny_sd3_dir, prompt_file, *extra, "trainer.max_steps=3"))
    resumed.train()
    straight = build_trainer(small_config(tmp_path / "s", tiny_sd3_dir, prompt_file, *extra, "trainer.max_steps=3"))
    straight.train()
    assert all(torch.equal(a, b) for a, b in zip(resumed.params, straight.params))
