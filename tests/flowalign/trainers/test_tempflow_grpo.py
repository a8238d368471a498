"""TempFlow-GRPO: branching at one chosen step per group and noise-aware weights (docs/methods/tempflow_grpo.md)."""

import math

import torch

from flowalign.sampling import branch_candidates, flow_grpo_diffusion, noise_aware_weights
from flowalign.train import build_trainer
from flowalign.trainers.tempflow_grpo import weighted_clip_loss

from .conftest import small_config
from .resume_check import assert_trains_and_resumes_bit_exactly


def test_noise_aware_weights_are_the_step_stds_over_their_mean():
    """Known answer on the grid σ = (1, 0.75, 0.5, 0.25, 0) with Flow-GRPO's s = a·sqrt(σ/(1−σ)), a = 0.7:
    τ_k = s_k·sqrt(0.25); w_k = τ_k / mean τ, the earliest (noisiest) step weighing most."""
    sigmas = torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0])
    w = noise_aware_weights(sigmas, [0, 1, 2], "flow_grpo", 0.7)
    s = [0.7 * math.sqrt(1 / 0.25), 0.7 * math.sqrt(0.75 / 0.25), 0.7 * math.sqrt(0.5 / 0.5)]  # σ=1: σ̃ = σ'
    tau = [x * 0.5 for x in s]
    for k in (0, 1, 2):
        assert math.isclose(w[k], tau[k] / (sum(tau) / 3), rel_tol=1e-6)
    assert math.isclose(sum(w.values()) / 3, 1, rel_tol=1e-9) and w[0] > w[1] > w[2]
    assert math.isclose(float(flow_grpo_diffusion(1.0, 0.75, 0.7)), s[0], rel_tol=1e-6)
    dance = noise_aware_weights(sigmas, [0, 3], "dance", 0.3)  # constant η: equal gaps, equal weights
    assert dance == {0: 1.0, 3: 1.0}
    assert branch_candidates(5, None) == [0, 1, 2, 3] and branch_candidates(5, [2, 0, 2]) == [0, 2]


def test_the_weighted_clip_loss_and_its_gradient_by_hand():
    """L_i = w·max(−A·r, −A·clip(r)); on-policy r = 1 and ∂L_i/∂ℓ_i = −w·A_i."""
    log_prob = torch.tensor([0.3, -0.2, 0.1], requires_grad=True)
    adv = torch.tensor([1.0, -2.0, 0.5])
    loss, ratio, clipped = weighted_clip_loss(log_prob, log_prob.detach(), adv, 0.2, 1.5)
    assert torch.equal(ratio, torch.ones(3)) and not clipped.any()
    loss.sum().backward()
    torch.testing.assert_close(log_prob.grad, -1.5 * adv)


def test_groups_branch_at_one_chosen_step_from_a_shared_ode_prefix(tmp_path, tiny_sd3_dir, prompt_file):
    t = build_trainer(small_config(tmp_path / "r", tiny_sd3_dir, prompt_file, "trainer.name=tempflow_grpo",
                                   "trainer.num_steps=5", "trainer.branch_steps=[1, 3]", "trainer.prompts_per_step=4"))
    batch = t.collect(0)
    seen = set()
    for chunk in batch.chunks:  # batch_size = group_size: one group per rollout batch
        (k,) = chunk.trained_steps()
        seen.add(k)
        assert k in (1, 3)
        assert torch.isnan(chunk.log_probs[:, [j for j in range(5) if j != k]]).all()  # ODE elsewhere
        prefix = chunk.latents[:, : k + 1]  # x_T … x_k: the same for every member (shared x_T, ODE)
        torch.testing.assert_close(prefix, prefix[:1].expand_as(prefix), atol=1e-6, rtol=0)
        assert not torch.allclose(chunk.latents[0, k + 1], chunk.latents[1, k + 1])  # each branch its own noise
        with torch.no_grad():  # on-policy: the ratio is exactly 1, the surrogate is −w_k·A
            out = t.step_distribution(chunk, k, t.policy_velocity(chunk, k, True))
            adv = batch.per_chunk(batch.advantages)[batch.chunks.index(chunk)]
            per_sample, ratio, _ = t.surrogate(chunk, k, out, chunk.step(k)[2], adv, None)
        assert torch.equal(ratio, torch.ones_like(ratio))
        w = noise_aware_weights(chunk.sigmas, [1, 3], "flow_grpo", 0.7)[k]
        torch.testing.assert_close(per_sample, -w * adv)
    again = build_trainer(small_config(tmp_path / "s", tiny_sd3_dir, prompt_file, "trainer.name=tempflow_grpo",
                                       "trainer.num_steps=5", "trainer.branch_steps=[1, 3]",
                                       "trainer.prompts_per_step=4"))
    assert [again.branch_step(g) for g in range(4)] == [t.branch_step(g) for g in range(4)]  # keyed, not random
    assert len({t.branch_step(g) for g in range(16)}) == 2  # both candidates drawn


def test_trains_and_resumes_bit_exactly(tmp_path, tiny_sd3_dir, prompt_file):
    assert_trains_and_resumes_bit_exactly(tmp_path, tiny_sd3_dir, prompt_file, "trainer.name=tempflow_grpo",
                                          "trainer.updates_per_epoch=2", "trainer.batch_size=2")
