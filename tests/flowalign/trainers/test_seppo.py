"""SePPO: a stored previous checkpoint's own samples as the losing images, selected by the anchor
criterion (docs/methods/seppo.md). The paper's equations (*SePPO: Semi-Policy Preference Optimization for
Diffusion Alignment*, arXiv 2410.05255) are checked on small fixed tensors with the numbers worked here."""

import math
from pathlib import Path

import pytest
import torch

from flowalign.config import load_config
from flowalign.errors import UserError
from flowalign.train import build_trainer
from flowalign.trainers.diffusion_dpo import diffusion_dpo_loss
from flowalign.trainers import trainer_config
from flowalign.trainers.seppo import SePPOConfig, anchor_signs, pick_reference, seppo_loss, stored_references

from .conftest import small_config, small_run
from .resume_check import assert_trains_and_resumes_bit_exactly

VVR = ("trainer.name=seppo", "data.prompts=null", "data.bench=vvr", "data.level=easy", "data.n=16", "rewards=[]",
       "trainer.dpo_beta=200")


def test_anchor_criterion_on_a_constructed_case():
    """The policy fits the winning image better than the reference on pair 0 (reference sample: a
    negative), worse on pair 1 (learnt towards) and equally on pair 2: the paper's sign is 0 there (the
    sample left out), its indicator ablation 0 on pairs 1 and 2, the former form −1 (learnt towards)."""
    err_w, ref_w = torch.tensor([0.1, 0.3, 0.2]), torch.tensor([0.2, 0.2, 0.2])
    assert anchor_signs(err_w, ref_w).tolist() == [1.0, -1.0, 0.0]
    assert anchor_signs(err_w, ref_w, "sign").tolist() == [1.0, -1.0, 0.0]
    assert anchor_signs(err_w, ref_w, "indicator").tolist() == [1.0, 0.0, 0.0]
    assert anchor_signs(err_w, ref_w, "tie_negative").tolist() == [1.0, -1.0, -1.0]
    with pytest.raises(ValueError, match="unknown form"):
        anchor_signs(err_w, ref_w, "flip")


# Three pairs, β = 2 (β/2 = 1), each error a number: the winning image's e_θ − e_ref = −0.1, +0.1, 0 (the
# policy fits it better, worse, equally) and the reference sample's e_θ − e_ref = +0.1 on all three.
# With u = −(β/2)·Δ, Δ = (e_θʷ − e_refʷ) − s·(e_θʳ − e_refʳ), L = −log σ(u) = log(1 + e^(−u)):
#   sign:         s = (+1, −1, 0): Δ = (−0.2, 0.2, 0),  u = (0.2, −0.2, 0)
#                 L = (log(1 + e^−0.2), log(1 + e^0.2), log 2) = (0.5981388694, 0.7981388694, 0.6931471806)
#   indicator:    s = (1, 0, 0):   Δ = (−0.2, 0.1, 0),  u = (0.2, −0.1, 0),  L₁ = log(1 + e^0.1) = 0.7443966601
#   tie_negative: s = (1, −1, −1): Δ = (−0.2, 0.2, 0.1), u = (0.2, −0.2, −0.1)
# and the gradients dL/de_θʷ = (β/2)·σ(−u), dL/de_θʳ = −s·(β/2)·σ(−u), with σ(−0.2) = 0.4501660027,
# σ(0.2) = 0.5498339973, σ(0.1) = 0.5249791875, σ(0) = 0.5.
_ERRORS = dict(err_w=[0.1, 0.3, 0.2], err_r=[0.5, 0.5, 0.5], ref_w=[0.2, 0.2, 0.2], ref_r=[0.4, 0.4, 0.4])
_WORKED = {
    "sign": ([0.5981388694, 0.7981388694, 0.6931471806], [0.4501660027, 0.5498339973, 0.5],
             [-0.4501660027, 0.5498339973, 0.0], (1 / 3, 1 / 3, 1 / 3)),
    "indicator": ([0.5981388694, 0.7443966601, 0.6931471806], [0.4501660027, 0.5249791875, 0.5],
                  [-0.4501660027, 0.0, 0.0], (1 / 3, 0.0, 2 / 3)),
    "tie_negative": ([0.5981388694, 0.7981388694, 0.7443966601], [0.4501660027, 0.5498339973, 0.5249791875],
                     [-0.4501660027, 0.5498339973, 0.5249791875], (1 / 3, 2 / 3, 0.0)),
}


@pytest.mark.parametrize("form", ["sign", "indicator", "tie_negative"])
def test_the_papers_loss_and_its_anchor_on_worked_numbers(form):
    """The paper's loss with the AAF sign (its default), the indicator of its ablation and the former form,
    against the numbers worked above: a wrong sign direction, a tie read as −1 under ``sign``, a missing
    factor β/2, or a reference term not detached fails here."""
    err_w = torch.tensor(_ERRORS["err_w"], dtype=torch.float64, requires_grad=True)
    err_r = torch.tensor(_ERRORS["err_r"], dtype=torch.float64, requires_grad=True)
    ref_w = torch.tensor(_ERRORS["ref_w"], dtype=torch.float64, requires_grad=True)
    ref_r = torch.tensor(_ERRORS["ref_r"], dtype=torch.float64, requires_grad=True)
    loss, stats = seppo_loss(err_w, err_r, ref_w, ref_r, beta=2.0, form=form)
    want_loss, want_gw, want_gr, (negative, flipped, tied) = _WORKED[form]
    torch.testing.assert_close(loss, torch.tensor(want_loss, dtype=torch.float64), rtol=0, atol=1e-9)
    loss.sum().backward()
    torch.testing.assert_close(err_w.grad, torch.tensor(want_gw, dtype=torch.float64), rtol=0, atol=1e-9)
    torch.testing.assert_close(err_r.grad, torch.tensor(want_gr, dtype=torch.float64), rtol=0, atol=1e-9)
    assert ref_w.grad is None and ref_r.grad is None
    got = [float(stats[k]) for k in ("negative_frac", "flip_frac", "tie_frac")]
    assert got == pytest.approx([negative, flipped, tied], abs=1e-6)


def test_the_default_is_the_papers_sign_and_a_run_saved_before_resumes_with_the_former_form():
    tc = SePPOConfig()
    assert tc.anchor and tc.anchor_sign == "sign" and tc.max_references is None
    before, when = SePPOConfig.former_forms()
    assert before["anchor_sign"] == "tie_negative" and when["anchor_sign"] == ("anchor", (True,))
    recipe = Path(__file__).resolve().parents[3] / "configs" / "tiny" / "seppo_vvr.yaml"
    assert load_config(recipe).trainer["anchor_sign"] == "tie_negative"  # as measured


def test_loss_and_gradient_match_hand_computed_values():
    beta = 2.0
    err_w = torch.tensor([0.1, 0.3], requires_grad=True)
    err_r = torch.tensor([0.5, 0.5], requires_grad=True)
    ref_w, ref_r = torch.tensor([0.2, 0.2]), torch.tensor([0.4, 0.4])
    loss, stats = seppo_loss(err_w, err_r, ref_w, ref_r, beta)
    # pair 0: s = +1, Δ = −0.1 − 0.1 = −0.2, u = −βΔ/2 = 0.2; pair 1: s = −1, Δ = 0.1 + 0.1 = 0.2, u = −0.2
    u = torch.tensor([0.2, -0.2])
    torch.testing.assert_close(loss, -torch.nn.functional.logsigmoid(u))
    assert stats["negative_frac"] == 0.5
    loss.sum().backward()
    # dL/de_w = (β/2)·σ(−u), dL/de_r = −s·(β/2)·σ(−u)
    g = (beta / 2) * torch.sigmoid(-u)
    torch.testing.assert_close(err_w.grad, g)
    torch.testing.assert_close(err_r.grad, torch.tensor([-1.0, 1.0]) * g)
    assert math.isclose(loss[0].item(), -math.log(1 / (1 + math.exp(-0.2))), rel_tol=1e-6)


def test_without_the_anchor_it_is_diffusion_dpo_against_the_reference_sample():
    e = [torch.rand(5, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    plain, _ = seppo_loss(*e, beta=300.0, anchor=False)
    torch.testing.assert_close(plain, diffusion_dpo_loss(*e, beta=300.0)[0])


def test_reference_errors_take_no_gradient():
    ref_w = torch.tensor([0.2], requires_grad=True)
    ref_r = torch.tensor([0.4], requires_grad=True)
    loss, _ = seppo_loss(torch.tensor([0.1], requires_grad=True), torch.tensor([0.5]), ref_w, ref_r, 2.0)
    loss.sum().backward()
    assert ref_w.grad is None and ref_r.grad is None


def test_every_checkpoint_is_kept_by_default_and_a_pool_past_the_limit_is_refused():
    """The paper draws among all previous checkpoints (ref ~ U(0, k−1)): by default none is dropped, so a run
    of 200 steps storing every 10 holds 21; a pool over MAX_WEIGHT_COPIES is refused, naming the option."""
    assert stored_references(SePPOConfig(max_steps=200, reference_every=10)) == 21
    assert stored_references(SePPOConfig(max_steps=200, reference_every=10, max_references=8)) == 8
    with pytest.raises(UserError, match="trainer.max_references"):
        trainer_config({"name": "seppo", "max_steps": 100_000, "reference_every": 1})


def test_reference_selection():
    g = torch.Generator().manual_seed(0)
    assert pick_reference([0, 10, 20], "latest", g) == 2 and pick_reference([0], "random", g) == 0
    drawn = {pick_reference([0, 10, 20], "random", g) for _ in range(50)}
    assert drawn == {0, 1, 2}


def test_reference_samples_come_from_the_stored_checkpoint_not_the_current_weights(tmp_path, tiny_sd3_dir,
                                                                                  prompt_file):
    """After a step the live weights moved; the next step's losing images are what a fresh model at the
    starting weights (the only stored checkpoint) samples, bit for bit, and not what the live weights sample."""
    def make(name, *extra):
        torch.manual_seed(0)
        return build_trainer(small_config(tmp_path / name, tiny_sd3_dir, prompt_file, *VVR,
                                          "trainer.reference_every=100", *extra))

    t = make("trained", "trainer.max_steps=1")
    t.train()
    live = [p.detach().clone() for p in t.params]
    batch = t.collect(1)
    assert all(torch.equal(a, b) for a, b in zip(live, t.params))  # sampling under the reference restored them
    assert batch.logs["reference/step"] == 0 and batch.logs["reference/age"] == 1
    fresh = make("fresh")
    idx = t.step_pairs(1)
    prompts, meta = [t.images.pairs.prompts[i] for i in idx], [t.images.pairs.metadata[i] for i in idx]
    from_start = fresh.reference_samples([p.detach().clone() for p in fresh.params], prompts, meta, 1)
    from_live = t.reference_samples(live, prompts, meta, 1)
    assert torch.equal(batch.x_l, from_start)
    assert not torch.equal(batch.x_l, from_live)
    # the winning side is the rendered scene of each task
    torch.testing.assert_close(batch.x_w, t.images.latents(idx).to(batch.x_w))


def test_checkpoints_are_stored_every_reference_every_steps_and_the_oldest_dropped(tmp_path, tiny_sd3_dir,
                                                                                    prompt_file):
    torch.manual_seed(0)
    t = build_trainer(small_config(tmp_path / "r", tiny_sd3_dir, prompt_file, *VVR, "trainer.max_steps=3",
                                   "trainer.reference_every=1", "trainer.max_references=2",
                                   "trainer.reference_selection=latest"))
    t.train()
    assert t.reference_steps == [2, 3]
    assert all(torch.equal(a, b) for a, b in zip(t.references[-1], t.params))  # the newest is the live weights
    assert not all(torch.equal(a, b) for a, b in zip(t.references[0], t.params))
    assert t.collect(3).logs["reference/step"] == 3


def test_at_the_first_step_the_reference_is_the_live_weights_so_every_sign_is_zero(tmp_path, tiny_sd3_dir,
                                                                                   prompt_file):
    """The first step's only stored checkpoint is the starting weights: its errors equal the policy's bit for
    bit, so under the paper's sign every pair ties (s = 0) and only its winning image is learnt (the former
    form would learn towards the reference's own sample); a run keeps every checkpoint it stores."""
    torch.manual_seed(0)
    t = build_trainer(small_config(tmp_path / "r", tiny_sd3_dir, prompt_file, *VVR, "trainer.max_steps=2",
                                   "trainer.reference_every=1"))
    batch = t.collect(0)
    unit = t.plan(batch, torch.Generator().manual_seed(0)).steps[0][0]
    err_w, err_r = t.errors(batch, unit.index, unit.t, unit.eps)
    assert torch.equal(err_w, unit.ref_w.to(err_w)) and torch.equal(err_r, unit.ref_l.to(err_r))
    _, stats = t.loss(batch, unit)
    assert stats["tie_frac"] == 1.0 and stats["flip_frac"] == 0.0
    t.train()
    assert t.reference_steps == [0, 1, 2]  # the starting weights stay a candidate


def test_prompts_without_images_are_refused(tmp_path, tiny_sd3_dir, prompt_file):
    with pytest.raises(UserError, match="image, caption"):
        build_trainer(load_config(None, small_run(tmp_path / "r", tiny_sd3_dir, prompt_file, "trainer.name=seppo",
                                                  "rewards=[]")))


def test_trains_and_resumes_bit_exactly_with_its_stored_checkpoints(tmp_path, tiny_sd3_dir, prompt_file):
    """A checkpoint taken after step 1 is the reference of step 2: resume must restore it exactly."""
    assert_trains_and_resumes_bit_exactly(tmp_path, tiny_sd3_dir, prompt_file, *VVR, "trainer.reference_every=1",
                                          "trainer.reference_selection=latest")
