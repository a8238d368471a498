"""DGPO (docs/methods/dgpo.md): the group preference on a hand example, the surrogate's gradient against
the group DPO loss's, the clipping, the authors' loss as known answers (known_answers/dgpo_loss.json), one
optimiser step per epoch, and a short run that resumes bit-exactly (with and without CFG)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from flowalign.train import build_trainer
from flowalign.trainers.dgpo import clipped_denoising_loss, dgpo_loss, group_scores, optimiser_steps

from .conftest import small_config


KNOWN = json.loads((Path(__file__).parent / "known_answers" / "dgpo_loss.json").read_text())


@pytest.mark.parametrize("case", KNOWN["cases"], ids=lambda c: f"beta{c['beta_dpo']}-clip{c['clip_range']}-kl{c['kl_beta']}")
def test_loss_and_gradient_equal_the_authors_train_sd3_dgpo(case):
    """``train_sd3_dgpo.py``'s loss of one timestep (clipping, group weights σ(S_g), KL) and its gradient in
    the policy's velocity, from flowalign's pieces summed over the samples as the trainer weights them."""
    target, v_ref, v_old, adv = (torch.tensor(KNOWN[k], dtype=torch.float64)
                                 for k in ("target_v", "ref_v", "old_v", "advantages"))
    v = torch.tensor(KNOWN["model_v"], dtype=torch.float64).requires_grad_(True)
    groups, n = torch.tensor(KNOWN["groups"]), len(adv)
    per = lambda x: x.flatten(1).mean(1)
    d, d_ref, d_old = per((v - target) ** 2), per((v_ref - target) ** 2), per((v_old - target) ** 2)
    if case["clip_range"] > 0:
        d, clipped = clipped_denoising_loss(d, d_old, adv, case["clip_range"])
        assert clipped.tolist() == case["clipped"]
    policy = dgpo_loss(d, d_ref, adv, groups, case["beta_dpo"], KNOWN["group_size"]).sum() / n
    loss = policy + case["kl_beta"] * per((v - v_ref) ** 2).sum() / n
    loss.backward()
    torch.testing.assert_close(policy.item(), case["policy_loss"], rtol=1e-6, atol=0)
    torch.testing.assert_close(loss.item(), case["loss"], rtol=1e-6, atol=0)
    torch.testing.assert_close(v.grad, torch.tensor(case["grad_model_v"], dtype=torch.float64), rtol=1e-6, atol=1e-15)


def test_one_optimiser_step_per_epoch_or_per_timestep():
    """The authors accumulate every batch and trained timestep of an epoch into one step; ``timestep`` is
    the former one step per trained timestep. Either way every (epoch, timestep) is trained once, in order."""
    ks = [[3, 0, 5], [1, 4, 2]]
    assert optimiser_steps(ks, "epoch") == [[3, 0, 5], [1, 4, 2]]
    assert optimiser_steps(ks, "timestep") == [[3], [0], [5], [1], [4], [2]]


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
             *(("trainer.guidance_scale=1.0", "trainer.reference_guidance=4.5") if cfg == "without" else
               ("trainer.sample_with_average_after=0",)))  # from the second step on, sampled with the average
    first = build_trainer(small_config(tmp_path / "r", tiny_sd3_dir, prompt_file, *extra))
    before = [p.detach().clone() for p in first.params]
    first.train()
    assert any(not torch.equal(a, b) for a, b in zip(before, first.params))
    resumed = build_trainer(small_config(tmp_path / "r", tiny_sd3_dir, prompt_file, *extra, "trainer.max_steps=3"))
    resumed.train()
    straight = build_trainer(small_config(tmp_path / "s", tiny_sd3_dir, prompt_file, *extra, "trainer.max_steps=3"))
    straight.train()
    assert all(torch.equal(a, b) for a, b in zip(resumed.params, straight.params))
    assert all(torch.equal(a, b) for a, b in zip(resumed.average.shadow, straight.average.shadow))


def test_the_old_losses_come_from_the_moving_average_which_moves_as_the_authors_ema_ref(tmp_path, tiny_sd3_dir,
                                                                                         prompt_file):
    """The clip's d_old are the denoising losses under the moving average (the authors' ``ema_ref``), not under
    the weights that sampled (``old_policy: sampling``, the former form); after a batch the average moves
    ``φ ← d·φ + (1−d)·θ`` with d = min(0.3, 0.001·s), s their ``global_step`` at the update."""
    import dataclasses

    from flowalign.trainers.base import GroupTrainer

    t = build_trainer(small_config(tmp_path / "r", tiny_sd3_dir, prompt_file, "trainer.name=dgpo",
                                   "trainer.train_timesteps=1", "trainer.last_step=2", "trainer.batch_size=4"))
    with torch.no_grad():
        for s in t.average.shadow:
            s.add_(0.05 * torch.randn(s.shape, generator=torch.Generator().manual_seed(s.numel())))
    batch = t.collect(0)
    batch = dataclasses.replace(batch, advantages=torch.linspace(-1, 1, len(batch.advantages)))
    unit = t.plan(batch, torch.Generator().manual_seed(0)).steps[0][0]
    with torch.no_grad():
        live = t.denoising_loss(batch, unit)
        with t.average.swapped_in():
            averaged = t.denoising_loss(batch, unit)
    torch.testing.assert_close(unit.d_old, averaged, rtol=0, atol=0)
    assert not torch.allclose(live, averaged, rtol=1e-3)
    t.tcfg = t.tcfg.model_copy(update={"old_policy": "sampling"})
    saved, t.average = t.average, None
    unit = t.plan(batch, torch.Generator().manual_seed(0)).steps[0][0]
    torch.testing.assert_close(unit.d_old, live, rtol=0, atol=0)
    t.average = saved
    for step in (0, 299, 400):  # one optimiser step a batch: s = the step
        t.step, before = step, [s.clone() for s in t.average.shadow]
        assert t.finish(batch, [{}])["old_decay"] == pytest.approx(min(0.3, 0.001 * step))
        d = min(0.3, 0.001 * step)
        for s, b, p in zip(t.average.shadow, before, t.params):
            torch.testing.assert_close(s, d * b + (1 - d) * p.detach(), rtol=1e-6, atol=1e-7)
    t.step = 1  # past sample_with_average_after: the rollouts are the average's
    t.tcfg = t.tcfg.model_copy(update={"sample_with_average_after": 0})
    with torch.no_grad():
        for s in t.average.shadow:
            s.add_(0.05)
    sampled = t.collect(1)
    with t.average.swapped_in():
        expected = GroupTrainer.collect(t, 1)
    assert all(torch.equal(a.final_latents, b.final_latents) for a, b in zip(sampled.chunks, expected.chunks))
    assert not torch.equal(sampled.chunks[0].final_latents, GroupTrainer.collect(t, 1).chunks[0].final_latents)


def test_dpm2_rollouts_run_on_the_schedulers_flow_grid_with_integer_timesteps(tmp_path, tiny_sd3_dir, prompt_file):
    """``rollout_solver: dpm2``: the rollouts' grid is DPMSolverMultistepScheduler's own flow grid (σ_0 < 1) and
    the transformer reads its integer timesteps, as the authors' scheduler loop does."""
    trainer = build_trainer(small_config(tmp_path / "r", tiny_sd3_dir, prompt_file, "trainer.name=dgpo",
                                         "trainer.rollout_solver=dpm2", "trainer.num_steps=4"))
    seen: list[torch.Tensor] = []
    # a forward hook sees the keywords forward ran with (after every pre-hook)
    handle = trainer.policy.transformer.register_forward_hook(
        lambda m, a, kw, out: seen.append(kw["timestep"].detach().clone()), with_kwargs=True)
    try:
        batch = trainer.collect(0)
    finally:
        handle.remove()
    from diffusers import DPMSolverMultistepScheduler

    theirs = DPMSolverMultistepScheduler(use_flow_sigmas=True, prediction_type="flow_prediction", flow_shift=3.0)
    theirs.set_timesteps(4)
    chunk = batch.chunks[0]
    assert chunk.sampler == "dpm2" and torch.equal(chunk.sigmas, theirs.sigmas.float())
    assert {float(t) for s in seen for t in s} == {float(t) for t in theirs.timesteps}


LEVELS = json.loads((Path(__file__).parent / "known_answers" / "dgpo_training_level.json").read_text())


@pytest.mark.parametrize("case", LEVELS["cases"], ids=lambda c: f"{c['num_steps']}steps")
def test_a_dpm2_training_step_renoises_at_the_authors_integer_timestep(case, tmp_path, tiny_sd3_dir, prompt_file):
    """With ``dpm2`` rollouts a trained grid step re-noises at t/1000 (float32) and the transformer reads the
    integer t, t the scheduler's timestep, as the authors' ``sigmas_t = t / 1000``; ``model_timestep:
    continuous`` (the former form) and Euler rollouts train at the grid's σ."""
    from types import SimpleNamespace

    from flowalign.trainers.dgpo import rollout_sampler

    trainer = build_trainer(small_config(tmp_path / "r", tiny_sd3_dir, prompt_file, "trainer.name=dgpo",
                                         "trainer.rollout_solver=dpm2"))
    grid = rollout_sampler(trainer.tcfg).sigmas(None, case["num_steps"])
    assert grid.tolist() == case["sigmas"]
    batch = SimpleNamespace(chunks=[SimpleNamespace(sigmas=grid)])
    for k, (t, sigma_t) in enumerate(zip(case["timesteps"], case["sigmas_t"])):
        sigma, form = trainer.level(batch, 0, k)
        assert sigma == sigma_t and form(torch.tensor([1000.0 * sigma])).item() == t
    trainer.tcfg = trainer.tcfg.model_copy(update={"model_timestep": "continuous"})
    assert [trainer.level(batch, 0, k) for k in range(3)] == [(float(grid[k]), None) for k in range(3)]
    assert float(grid[1]) != case["sigmas_t"][1]  # the two forms differ


def test_the_transformer_reads_the_integer_timestep_at_the_state_the_authors_renoise(tmp_path, tiny_sd3_dir, prompt_file):
    """One unit's denoising loss on the tiny model with ``dpm2`` rollouts: the transformer is called with the
    integer timestep and the state (1 - t/1000)·x0 + (t/1000)·ε, the authors' float32 arithmetic, bit for bit."""
    trainer = build_trainer(small_config(tmp_path / "r", tiny_sd3_dir, prompt_file, "trainer.name=dgpo",
                                         "trainer.rollout_solver=dpm2", "trainer.num_steps=4", "trainer.clip_range=0"))
    batch = trainer.collect(0)
    unit = trainer.plan(batch, torch.Generator().manual_seed(0)).steps[0][0]
    seen = []
    handle = trainer.policy.transformer.register_forward_hook(
        lambda m, a, kw, out: seen.append((kw["hidden_states"].detach().clone(), kw["timestep"].detach().clone())),
        with_kwargs=True)
    try:
        trainer.denoising_loss(batch, unit)
    finally:
        handle.remove()
    t = torch.tensor(LEVELS["cases"][1]["timesteps"][unit.k])  # int64, as their stored timesteps
    sigma_t = (t / 1000).reshape(1, 1, 1, 1)
    x0 = trainer.block(batch, unit.chunks)[0]
    (hidden, timestep), = seen
    assert torch.equal(hidden, (1 - sigma_t) * x0 + sigma_t * unit.eps.to(x0))
    assert timestep.tolist() == [float(t)] * len(x0)


def test_a_run_saved_before_the_moving_average_resumes_only_as_it_was(tmp_path, tiny_sd3_dir, prompt_file):
    """A DGPO run of an earlier flowalign (no ``old_policy``: the sampling weights' old losses) is refused under
    the default with the line that continues it as it was, and resumes with it."""
    import yaml

    from flowalign.errors import UserError

    extra = ("trainer.name=dgpo", "trainer.train_timesteps=1", "trainer.last_step=2", "trainer.batch_size=4",
             "run.checkpoint_every=1")
    build_trainer(small_config(tmp_path / "r", tiny_sd3_dir, prompt_file, *extra, "trainer.old_policy=sampling",
                               "trainer.max_steps=1")).train()
    saved = tmp_path / "r" / "config.yaml"  # as the earlier flowalign wrote it: without the three options
    config = yaml.safe_load(saved.read_text())
    for key in ("old_policy", "old_decay", "sample_with_average_after"):
        del config["trainer"][key]
    saved.write_text(yaml.safe_dump(config))
    with pytest.raises(UserError, match=r"computed trainer.old_policy=sampling; add trainer.old_policy=sampling"):
        build_trainer(small_config(tmp_path / "r", tiny_sd3_dir, prompt_file, *extra, "trainer.max_steps=2"))
    resumed = build_trainer(small_config(tmp_path / "r", tiny_sd3_dir, prompt_file, *extra, "trainer.max_steps=2",
                                         "trainer.old_policy=sampling"))
    resumed.train()
    assert resumed.step == 2 and resumed.average is None
