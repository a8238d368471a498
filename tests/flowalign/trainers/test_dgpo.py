"""DGPO (docs/methods/dgpo.md): the group preference on a hand example, the surrogate's gradient against
the group DPO loss's, the clipping, and a short run that resumes bit-exactly (with and without CFG)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from flowalign.train import build_trainer
from flowalign.trainers.dgpo import clipped_denoising_loss, dgpo_loss, group_scores

from .conftest import small_config


def test_group_score_by_hand():
    """Group 0: A = (1, −1), d − d_ref = (−0.01, +0.01) → S = (β/G)·(−0.02); group 1 has no preference."""
    d = torch.tensor([0.49, 0.51, 0.3, 0.3])
    d_ref = torch.tensor([0.5, 0.5, 0.3, 0.3])
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    groups = torch.tensor([0, 0, 1, 1])
    s = group_scores(d, d_ref, adv, groups, beta=100.0, group_size=2)
    torch.testing.assert_close(s, torch.tensor([-1.0, -1.0, 0.0, 0.0]))
    # the group already prefers its positive sample: its weight σ(−1) is below group 1's σ(0) = ½
    d = d.clone().requires_grad_()
    dgpo_loss(d, d_ref, adv, groups, 100.0, 2).sum().backward()
    torch.testing.assert_close(d.grad, torch.tensor([1 / (1 + math.e), -1 / (1 + math.e), 0.5, -0.5]))


def test_surrogate_gradient_is_the_group_dpo_gradient_times_g_over_beta():
    g = torch.Generator().manual_seed(0)
    v = torch.randn(6, 5, generator=g, requires_grad=True)
    target, ref = torch.randn(6, 5, generator=g), torch.randn(6, 5, generator=g)
    adv = torch.randn(6, generator=g)
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    beta, size = 3.0, 3
    d = ((v - target) ** 2).mean(1)
    d_ref = ((ref - target) ** 2).mean(1)
    (surrogate,) = torch.autograd.grad(dgpo_loss(d, d_ref, adv, groups, beta, size).sum(), v, retain_graph=True)
    s = torch.stack([(beta / size) * (adv[groups == k] * (d - d_ref)[groups == k]).sum() for k in (0, 1)])
    (exact,) = torch.autograd.grad((-F.logsigmoid(-s)).sum(), v)
    torch.testing.assert_close(surrogate, exact * size / beta)


def test_clipping_detaches_only_samples_past_the_range_on_their_side():
    d = torch.tensor([0.4, 0.4, 0.6, 0.6], requires_grad=True)
    d_old = torch.tensor([0.5, 0.5, 0.5, 0.5])  # r = e^{0.1} (A>0: clipped) … e^{−0.1} (A<0: clipped)
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    out, clip = clipped_denoising_loss(d, d_old, adv, 0.05)
    assert clip.tolist() == [True, False, False, True]
    out.sum().backward()
    assert d.grad.tolist() == [0.0, 1.0, 1.0, 0.0]


@pytest.mark.parametrize("cfg", ["with", "without"])
def test_a_short_run_trains_and_resumes_bit_exactly(tmp_path, tiny_sd3_dir, prompt_file, cfg):
    extra = ("trainer.name=dgpo", "trainer.train_timesteps=2", "trainer.last_step=2", "trainer.batch_size=2",
             "run.checkpoint_every=1",
             *(("trainer.guidance_scale=1.0", "trainer.reference_guidance=4.5") if cfg == "without" else ()))
    first = build_trainer(small_config(tmp_path / "r", tiny_sd3_dir, prompt_file, *extra))
    before = [p.detach().clone() for p in first.params]
    first.train()
    assert any(not torch.equal(a, b) for a, b in zip(before, first.params))
    resumed = build_trainer(small_config(tmp_path / "r", tiny_sd3_dir, prompt_file, *extra, "trainer.max_steps=3"))
    resumed.train()
    straight = build_trainer(small_config(tmp_path / "s", tiny_sd3_dir, prompt_file, *extra, "trainer.max_steps=3"))
    straight.train()
    assert all(torch.equal(a, b) for a, b in zip(resumed.params, straight.params))
