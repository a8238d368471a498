"""GRPO-Guard: the normalised ratio and the per-step reweighting (docs/methods/grpo_guard.md)."""

import json
import math
from pathlib import Path

import pytest
import torch

from flowalign.sampling import flow_sde_step
from flowalign.train import build_trainer
from flowalign.trainers.parts.ratio_norm import guard_clip_loss, guard_ratio

from .conftest import small_config
from .resume_check import assert_trains_and_resumes_bit_exactly


def test_the_normalised_ratio_is_exp_of_noise_times_mean_shift():
    """x' = μ_old + τ·ξ: the plain ratio is pulled below 1 by −mean(Δμ²)/(2τ²) and scaled by 1/τ; the
    normalised one is exactly exp(mean(ξ·Δμ)). Known answer: ξ = (1, −1), Δμ = (0.2, 0.2) → r̃ = 1."""
    v_old, x = torch.zeros(1, 2), torch.ones(1, 2)
    old = flow_sde_step(v_old, x, 0.5, 0.4, diffusion=0.7)
    xi = torch.tensor([[1.0, -1.0]])
    x_next = old.mean + old.std * xi
    old = flow_sde_step(v_old, x, 0.5, 0.4, diffusion=0.7, prev_sample=x_next)
    new = flow_sde_step(v_old + 2.0, x, 0.5, 0.4, diffusion=0.7, prev_sample=x_next)
    tau = old.std.flatten(1)[:, 0]
    delta = new.mean - old.mean
    plain = torch.exp(new.log_prob - old.log_prob)
    assert plain.item() < 1  # left-shifted by the mean shift alone
    r = guard_ratio(new.log_prob, old.log_prob, new.mean, old.mean, tau)
    assert torch.allclose(r, torch.exp((xi * delta).mean(1)), atol=1e-6)
    assert abs(r.item() - 1.0) < 1e-6
    xi2 = torch.tensor([[1.0, 1.0]])  # noise along the shift: r̃ = exp(Δμ)
    new2 = flow_sde_step(v_old + 2.0, x, 0.5, 0.4, diffusion=0.7, prev_sample=old.mean + old.std * xi2)
    old2 = flow_sde_step(v_old, x, 0.5, 0.4, diffusion=0.7, prev_sample=old.mean + old.std * xi2)
    r2 = guard_ratio(new2.log_prob, old2.log_prob, new2.mean, old2.mean, tau)
    assert math.isclose(r2.item(), math.exp(delta[0, 0].item()), rel_tol=1e-5)


def test_the_reweighted_clip_loss_and_its_gradient():
    ratio = torch.tensor([1.0, 1.5, 0.5], requires_grad=True)
    adv = torch.tensor([1.0, 1.0, -1.0])
    loss, clipped = guard_clip_loss(ratio, adv, 0.2, 10.0)
    assert loss.tolist() == [-10.0, -12.0, 8.0] and clipped.tolist() == [False, True, True]
    loss.sum().backward()
    assert ratio.grad.tolist() == [-10.0, 0.0, 0.0]  # clipped samples pass no gradient


def test_on_policy_normalised_ratio_is_exactly_one_and_steps_are_reweighted(tmp_path, tiny_sd3_dir, prompt_file):
    t = build_trainer(small_config(tmp_path / "r", tiny_sd3_dir, prompt_file, "trainer.name=grpo_guard"))
    batch = t.collect(0)
    chunk, adv = batch.chunks[0], batch.per_chunk(batch.advantages)[0]
    for k in t.trained_steps(chunk):
        with torch.no_grad():
            out = t.step_distribution(chunk, k, t.policy_velocity(chunk, k, True))
            per_sample, ratio, _ = t.surrogate(chunk, k, out, chunk.step(k)[2], adv, None)
        assert torch.equal(ratio, torch.ones_like(ratio))
        gap = chunk.sigmas[k].item() - chunk.sigmas[k + 1].item()
        assert torch.allclose(per_sample, -adv / gap)


def test_trains_and_resumes_bit_exactly(tmp_path, tiny_sd3_dir, prompt_file):
    assert_trains_and_resumes_bit_exactly(tmp_path, tiny_sd3_dir, prompt_file, "trainer.name=grpo_guard",
                                          "trainer.updates_per_epoch=2")


KNOWN = json.loads((Path(__file__).parent / "known_answers" / "grpo_guard_ratio_loss.json").read_text())


@pytest.mark.parametrize("case", KNOWN["cases"], ids=lambda c: f"step{c['step']}")
def test_ratio_and_reweighted_loss_equal_the_authors(case):
    """The authors' rationorm ratio and ``policy_loss / sqrt_dt²`` on fixed float64 tensors (known_answers/);
    τ = sqrt_dt·std_dev_t is the step's std and sqrt_dt² the σ gap h."""
    t = {n: torch.tensor(case[n], dtype=torch.float64)
         for n in ("log_prob", "old_log_prob", "prev_sample_mean", "old_prev_sample_mean", "std_dev_t", "sqrt_dt")}
    adv = torch.tensor(KNOWN["advantages"], dtype=torch.float64)
    sigmas, k, eps = KNOWN["sigmas"], case["step"], KNOWN["clip_range"]
    tau = t["std_dev_t"] * t["sqrt_dt"]
    ratio = guard_ratio(t["log_prob"], t["old_log_prob"], t["prev_sample_mean"], t["old_prev_sample_mean"], tau)
    torch.testing.assert_close(ratio, torch.tensor(case["ratio"], dtype=torch.float64), rtol=1e-6, atol=0)
    per_sample, clipped = guard_clip_loss(ratio, adv, eps, 1.0 / (sigmas[k] - sigmas[k + 1]))
    assert clipped.any() and not clipped.all()  # the fixture exercises both branches of the clip
    assert math.isclose(per_sample.mean().item(), case["policy_loss"], rel_tol=1e-6)
    # ratio_bias "sample": each sample's own shift, so r̃ = exp(mean_D(ξ·Δμ)) with x' = μ_old + τ·ξ
    xi = (torch.tensor(case["prev_sample"], dtype=torch.float64) - t["old_prev_sample_mean"]) / tau[0]
    own = guard_ratio(t["log_prob"], t["old_log_prob"], t["prev_sample_mean"], t["old_prev_sample_mean"], tau, "sample")
    delta = t["prev_sample_mean"] - t["old_prev_sample_mean"]
    torch.testing.assert_close(own, torch.exp((xi * delta).flatten(1).mean(1)), rtol=1e-9, atol=0)
    assert not torch.allclose(own, ratio, rtol=1e-4)
    plain, _ = guard_clip_loss(torch.exp(t["log_prob"] - t["old_log_prob"]), adv, eps, 1.0)  # both off
    assert math.isclose(plain.mean().item(), case["policy_loss_plain"], rel_tol=1e-6)


def test_the_batch_shift_leaves_out_samples_without_advantage():
    """The authors drop zero-advantage samples before batching: the shift's batch mean runs over the others,
    so an active sample's r̃ is the one it has in the batch of active samples alone."""
    case = KNOWN["cases"][1]
    t = {n: torch.tensor(case[n], dtype=torch.float64)
         for n in ("log_prob", "old_log_prob", "prev_sample_mean", "old_prev_sample_mean", "std_dev_t", "sqrt_dt")}
    args = (t["log_prob"], t["old_log_prob"], t["prev_sample_mean"], t["old_prev_sample_mean"],
            t["std_dev_t"] * t["sqrt_dt"])
    active = torch.tensor([True, False, True])
    masked = guard_ratio(*args, "batch", active)
    alone = guard_ratio(*(a[active] for a in args), "batch")
    torch.testing.assert_close(masked[active], alone, rtol=1e-12, atol=0)
    assert not torch.allclose(masked, guard_ratio(*args, "batch"), rtol=1e-6)
    torch.testing.assert_close(guard_ratio(*args, "batch", torch.zeros(3, dtype=torch.bool)), guard_ratio(*args))
