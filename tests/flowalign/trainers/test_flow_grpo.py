"""Flow-GRPO on the tiny SD3 model: the method page's properties (docs/methods/flow_grpo.md)."""

import json
from pathlib import Path

import pytest
import torch

from flowalign.errors import UserError
from flowalign.train import build_trainer
from flowalign.sampling.steps import sde_step
from flowalign.trainers.flow_grpo import coded_kl_gap, gaussian_mean_kl
from flowalign.trainers.parts.policy_gradient import ppo_clip_loss

from .conftest import small_config


@pytest.fixture
def trainer(tmp_path, tiny_sd3_dir, prompt_file):
    return build_trainer(small_config(tmp_path / "run", tiny_sd3_dir, prompt_file, "trainer.beta=0.04"))


def test_first_on_policy_pass_has_ratio_exactly_one(trainer):
    prompts, metadata, groups = trainer.step_prompts(0)
    batch = trainer.sample(prompts, metadata, groups)
    assert [len(c) for c in batch.chunks] == [4, 4]  # chunks never span groups
    for chunk in batch.chunks:
        for k in trainer.trained_steps(chunk):
            stored = chunk.step(k)[2]
            with torch.no_grad():
                again = trainer.step_distribution(chunk, k, trainer.policy_velocity(chunk, k, True))
            assert torch.equal(again.log_prob, stored)


def test_kl_is_zero_with_the_adapter_disabled_and_positive_otherwise(trainer):
    with torch.no_grad():
        for p in trainer.params:
            p.add_(0.05 * torch.randn_like(p))
    prompts, metadata, groups = trainer.step_prompts(0)
    chunk = trainer.sample(prompts, metadata, groups).chunks[0]
    k = 1
    x_k = chunk.step(k)[0]
    sigma = chunk.sigmas[k].item()
    gap = sigma - chunk.sigmas[k + 1].item()

    def mean_of(ctx):
        with torch.no_grad(), ctx:
            return trainer.step_distribution(chunk, k, trainer.policy.velocity(x_k, sigma, chunk.cond, chunk.guidance_scale))

    adapted = mean_of(torch.enable_grad())
    ref = mean_of(trainer.policy.adapter_disabled())
    ref_again = mean_of(trainer.policy.adapter_disabled())
    assert torch.equal(gaussian_mean_kl(ref.mean, ref_again.mean, ref.std, gap, "exact"), torch.zeros(4))
    kl_exact = gaussian_mean_kl(adapted.mean, ref.mean, adapted.std, gap, "exact")
    kl_code = gaussian_mean_kl(adapted.mean, ref.mean, adapted.std, gap, "code")
    assert (kl_exact > 0).all()
    d = adapted.mean[0].numel()
    torch.testing.assert_close(kl_code, kl_exact * gap / d)  # coded form = (h/D)·exact


def test_clipped_surrogate_bounds_and_gradients():
    eps = 0.2
    old = torch.zeros(4)
    log_prob = torch.log(torch.tensor([1.5, 1.1, 0.5, 0.9])).requires_grad_()
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0])
    loss, ratio, clipped = ppo_clip_loss(log_prob, old, adv, eps)
    torch.testing.assert_close(loss, torch.tensor([-1.2, -1.1, 0.8, 0.9]))
    assert clipped.tolist() == [True, False, True, False]
    loss.sum().backward()
    assert log_prob.grad[0] == 0 and log_prob.grad[2] == 0  # clipped branches carry no gradient
    assert log_prob.grad[1] != 0 and log_prob.grad[3] != 0


def test_update_moves_only_the_adapter(trainer):
    base = {n: p.detach().clone() for n, p in trainer.policy.transformer.named_parameters() if not p.requires_grad}
    lora = [p.detach().clone() for p in trainer.params]
    logs = trainer.train_step()
    assert logs["train/ratio"] == pytest.approx(1.0, abs=1e-3)
    assert any(not torch.equal(a, p) for a, p in zip(lora, trainer.params))
    for n, p in trainer.policy.transformer.named_parameters():
        if n in base:
            assert torch.equal(base[n], p), n


def test_invalid_rewards_are_masked_and_counted(tmp_path, tiny_sd3_dir, prompt_file):
    reward = "rewards=[{name: 'tests.flowalign.trainers.toy_rewards:sometimes_nan'}]"
    t = build_trainer(small_config(tmp_path / "a", tiny_sd3_dir, prompt_file, reward))
    logs = t.train_step()
    assert logs["reward/invalid_fraction"] == 0.25
    assert logs["reward/tests.flowalign.trainers.toy_rewards:sometimes_nan_invalid_fraction"] == 0.25
    t = build_trainer(small_config(tmp_path / "b", tiny_sd3_dir, prompt_file, reward, "run.max_invalid_fraction=0.1"))
    with pytest.raises(UserError, match="invalid rewards"):
        t.train_step()


def test_flow_grpo_fast_window_trains_only_window_steps(tmp_path, tiny_sd3_dir, prompt_file):
    t = build_trainer(small_config(tmp_path / "w", tiny_sd3_dir, prompt_file, "trainer.num_steps=8", "trainer.sde_window=2"))
    prompts, metadata, groups = t.step_prompts(0)
    for chunk in t.sample(prompts, metadata, groups).chunks:
        steps = chunk.trained_steps()
        assert len(steps) == 2 and steps[1] == steps[0] + 1 and steps[0] + 2 <= 4


@pytest.mark.parametrize("name", ["flow_grpo", "flash_grpo"])
def test_shared_initial_noise_is_one_x_T_per_group(tmp_path, tiny_sd3_dir, prompt_file, name):
    """Every rollout of a group starts from the same x_T (different groups from different ones), across
    chunks; the SDE steps still make the samples differ. Off (the default), each rollout draws its own."""
    for shared in (True, False):
        t = build_trainer(small_config(tmp_path / f"{name}{shared}", tiny_sd3_dir, prompt_file, f"trainer.name={name}",
                                       "trainer.batch_size=2", f"trainer.shared_initial_noise={shared}"))
        prompts, metadata, groups = t.step_prompts(0)
        batch = t.sample(prompts, metadata, groups)
        x_T = torch.cat([c.latents[:, 0] for c in batch.chunks])
        final = torch.cat([c.latents[:, -1] for c in batch.chunks])
        firsts = []
        for g in torch.unique(groups):
            members = x_T[groups == g]
            assert torch.equal(members[0], members[1]) == shared
            assert not torch.equal(final[groups == g][0], final[groups == g][1])
            firsts.append(members[0])
        assert not torch.equal(firsts[0], firsts[1])


def test_missing_prompt_file(tmp_path, tiny_sd3_dir):
    with pytest.raises(UserError, match="prompt file .* does not exist"):
        build_trainer(small_config(tmp_path / "a", tiny_sd3_dir, tmp_path / "missing.txt"))
    assert not (tmp_path / "a").exists()  # refused before the run folder is written


@pytest.mark.parametrize("offload", [False, True])
def test_full_fine_tuning_with_kl_runs_a_frozen_copy_of_the_starting_weights(tmp_path, tiny_sd3_dir, prompt_file,
                                                                            offload):
    t = build_trainer(small_config(tmp_path / "run", tiny_sd3_dir, prompt_file, "model.finetune=full",
                                   "trainer.beta=0.1", "trainer.clip_range=0.2", "trainer.updates_per_epoch=2",
                                   f"trainer.reference_offload={offload}"))
    batch = t.collect(0)
    chunk = batch.chunks[0]
    x, sigma = chunk.latents[:, 1], chunk.sigmas[1].item()
    velocity = lambda: t.policy.velocity(x, sigma, chunk.cond, chunk.guidance_scale)
    with torch.no_grad():
        start = velocity()
        with t.policy.adapter_disabled():
            assert torch.equal(velocity(), start)  # the copy is the policy's starting weights
    logs = t.update(batch, torch.Generator().manual_seed(0))
    assert logs["kl"] > 0  # the second update's policy moved away from the reference
    with torch.no_grad():
        assert not torch.allclose(velocity(), start)  # trained (every weight: no adapter)
        with t.policy.adapter_disabled():
            assert torch.equal(velocity(), start)  # the reference did not move
        assert not torch.allclose(velocity(), start)  # and the trained weights are back after
    reference = t.policy.reference_modules["transformer"]
    live = {id(p) for p in t.params}
    assert all(not p.requires_grad and id(p) not in live for p in reference.parameters())


def test_training_raises_a_pixel_reward(tmp_path, tiny_sd3_dir, prompt_file):
    """The end-to-end property: the policy moves toward what the reward prefers (redder images)."""
    t = build_trainer(small_config(
        tmp_path / "red", tiny_sd3_dir, prompt_file, "model.finetune=full",
        "trainer.beta=0", "trainer.lr=1e-3", "trainer.clip_range=0.2", "trainer.group_size=8",
        "trainer.batch_size=8", "trainer.num_steps=6", "trainer.max_steps=30"))
    rewards = []
    for _ in range(30):
        rewards.append(t.train_step()["reward/total"])
        t.step += 1
    first, last = sum(rewards[:6]) / 6, sum(rewards[-6:]) / 6
    assert last > first + 0.005, rewards  # a 6-step mean moves ~0.0005 by noise alone


KNOWN_KL = json.loads((Path(__file__).parent / "known_answers" / "flow_grpo_step_kl.json").read_text())


@pytest.mark.parametrize("case", KNOWN_KL["cases"], ids=lambda c: f"{c['sde_type']}-step{c['step']}")
def test_step_log_prob_and_coded_kl_equal_flow_grpos(case):
    """flow_grpo's ``sde_step_with_logprob`` and ``train_sd3.py``'s KL on fixed tensors (known_answers/)."""
    sampler = {"sde": "flow_grpo", "cps": "cps"}[case["sde_type"]]
    sigmas = KNOWN_KL["sigmas"]
    x, v, v_ref, x_next = (torch.tensor(KNOWN_KL[n]) for n in ("sample", "velocity", "velocity_ref", "prev_sample"))
    k = case["step"]
    out = sde_step(sampler, v, x, sigmas[k], sigmas[k + 1], noise_level=case["noise_level"], prev_sample=x_next)
    ref = sde_step(sampler, v_ref, x, sigmas[k], sigmas[k + 1], noise_level=case["noise_level"], prev_sample=x_next)
    torch.testing.assert_close(out.mean, torch.tensor(case["prev_sample_mean"]), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(out.log_prob, torch.tensor(case["log_prob"]), rtol=1e-6, atol=1e-7)
    gap = coded_kl_gap(sampler, sigmas[k], sigmas[k + 1])
    kl = gaussian_mean_kl(out.mean, ref.mean, out.std, gap, "code")
    torch.testing.assert_close(kl, torch.tensor(case["kl_per_sample"]), rtol=1e-5, atol=1e-9)
