"""SePPO: a stored previous checkpoint's own samples as the losing images, selected by the anchor
criterion (docs/methods/seppo.md)."""

import math

import pytest
import torch

from flowalign.config import load_config
from flowalign.errors import UserError
from flowalign.train import build_trainer
from flowalign.trainers.diffusion_dpo import diffusion_dpo_loss
from flowalign.trainers.seppo import anchor_signs, pick_reference, seppo_loss

from .conftest import small_config, small_run
from .resume_check import assert_trains_and_resumes_bit_exactly

VVR = ("trainer.name=seppo", "data.prompts=null", "data.bench=vvr", "data.level=easy", "data.n=16", "rewards=[]",
       "trainer.dpo_beta=200")


def test_anchor_criterion_on_a_constructed_case():
    """The policy fits the winning image better than the reference on pair 0 (reference sample: a
    negative), worse on pair 1 and equally on pair 2 (both: learnt towards)."""
    err_w, ref_w = torch.tensor([0.1, 0.3, 0.2]), torch.tensor([0.2, 0.2, 0.2])
    assert anchor_signs(err_w, ref_w).tolist() == [1.0, -1.0, -1.0]


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


def test_prompts_without_images_are_refused(tmp_path, tiny_sd3_dir, prompt_file):
    with pytest.raises(UserError, match="image, caption"):
        build_trainer(load_config(None, small_run(tmp_path / "r", tiny_sd3_dir, prompt_file, "trainer.name=seppo",
                                                  "rewards=[]")))


def test_trains_and_resumes_bit_exactly_with_its_stored_checkpoints(tmp_path, tiny_sd3_dir, prompt_file):
    """A checkpoint taken after step 1 is the reference of step 2: resume must restore it exactly."""
    assert_trains_and_resumes_bit_exactly(tmp_path, tiny_sd3_dir, prompt_file, *VVR, "trainer.reference_every=1",
                                          "trainer.reference_selection=latest")
