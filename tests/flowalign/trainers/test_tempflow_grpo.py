"""TempFlow-GRPO: per-step branching (every step, the authors'; or one drawn step), noise-aware weights, and
the authors' advantages / weights / loss as known answers (known_answers/tempflow_grpo_branching_loss.json;
docs/methods/tempflow_grpo.md)."""

import json
import math
from pathlib import Path

import pytest
import torch

from flowalign.advantages import compute_advantages
from flowalign.errors import UserError
from flowalign.sampling import branch_candidates, flow_grpo_diffusion, noise_aware_weights
from flowalign.train import build_trainer
from flowalign.trainers import trainer_config
from flowalign.trainers.flow_grpo import gaussian_mean_kl
from flowalign.trainers.tempflow_grpo import branch_groups, step_variance_kl, weighted_clip_loss

from .conftest import small_config
from .resume_check import assert_trains_and_resumes_bit_exactly

KNOWN = json.loads((Path(__file__).parent / "known_answers" / "tempflow_grpo_branching_loss.json").read_text())
F64 = dict(dtype=torch.float64)


def close(actual, expected, rtol=1e-6, atol=1e-9):
    torch.testing.assert_close(torch.as_tensor(actual, **F64), torch.as_tensor(expected, **F64), rtol=rtol, atol=atol)


def test_branching_structure_equals_the_authors_script():
    """SD3.5 at T = 10: the authors branch at steps 0 … T−2 (their main path's timesteps[:-1]) and train
    exactly those (⌊0.99·10⌋ = 9 steps): flowalign's default candidates, each one trained by every_step."""
    b = KNOWN["branching"]
    assert branch_candidates(b["num_steps"], None) == b["branch_steps"] == b["trained_steps"]


def test_step_std_and_weights_equal_the_authors_sde_step():
    """τ_k (the std their SDE step returns) on SD3.5's grid; noise_weight_scale 2.25 gives their 2.25·τ_k
    exactly, and the normalised default τ_k / mean τ is within 0.1 % of it on this grid."""
    sigmas, steps = torch.tensor(KNOWN["sigmas"], **F64), KNOWN["branching"]["branch_steps"]
    scale = KNOWN["weight_scale"]
    authors = [scale * t for t in KNOWN["step_std"]]
    scaled = noise_aware_weights(sigmas, steps, "flow_grpo", KNOWN["noise_level"], scale)
    close([scaled[k] for k in steps], authors)
    normalised = noise_aware_weights(sigmas, steps, "flow_grpo", KNOWN["noise_level"])
    close([normalised[k] for k in steps], authors, rtol=2e-3)


def test_per_prompt_and_step_advantages_equal_the_authors_tracker():
    """The authors' (rows, T−1) reward matrix normalised per (prompt, step) column (PerPromptStatTracker,
    per-prompt std, eps 1e-4, clamped to 5) equals compute_advantages('group') over branch_groups ids."""
    a = KNOWN["advantages"]
    rewards = torch.tensor(a["rewards"], **F64)
    rows, steps = rewards.shape
    names = sorted(set(a["prompts"]))
    prompt = torch.tensor([names.index(p) for p in a["prompts"]]).repeat_interleave(steps)
    step = torch.arange(steps).repeat(rows)
    adv = compute_advantages("group", rewards.reshape(-1, 1), torch.ones(1), branch_groups(prompt, step, steps),
                             clip=a["adv_clip"])
    close(adv.reshape(rows, steps), a["advantages"], atol=1e-6)  # flowalign normalises in float32
    assert (torch.tensor(a["advantages"])[18:, 4] == 0).all() and (adv.reshape(rows, steps)[18:, 4] == 0).all()


@pytest.mark.parametrize("case", KNOWN["loss"], ids=lambda c: f"step{c['step']}")
def test_one_training_unit_equals_the_authors_loss_and_gradient(case):
    """policy_loss = mean 2.25·τ_k·max(−A·r, −A·clip(r)), its gradient in ℓ, the KL mean_D Δμ²/(2τ_k²) and
    loss = policy + β·KL, fed the authors' inputs (float64)."""
    sigmas, k = KNOWN["sigmas"], case["step"]
    weight = noise_aware_weights(torch.tensor(sigmas, **F64), KNOWN["branching"]["branch_steps"], "flow_grpo",
                                 KNOWN["noise_level"], KNOWN["weight_scale"])[k]
    log_prob = torch.tensor(case["log_prob"], **F64, requires_grad=True)
    per_sample, _, _ = weighted_clip_loss(log_prob, torch.tensor(case["old_log_prob"], **F64),
                                          torch.tensor(case["advantages"], **F64), case["clip_range"], weight)
    policy = per_sample.mean()
    policy.backward()
    close(policy.item(), case["policy_loss"])
    close(log_prob.grad, case["policy_loss_grad_log_prob"])
    std = torch.full((4, 1, 1, 1), case["std"], **F64)
    coded = gaussian_mean_kl(torch.tensor(case["mean"], **F64), torch.tensor(case["ref_mean"], **F64), std,
                             sigmas[k] - sigmas[k + 1], "code")
    kl = step_variance_kl(coded, sigmas[k], sigmas[k + 1]).mean()
    close(kl.item(), case["kl_loss"])
    close(policy.item() + case["beta"] * kl.item(), case["loss"])
    s = float(flow_grpo_diffusion(sigmas[k], sigmas[k + 1], KNOWN["noise_level"]))
    close(s * math.sqrt(sigmas[k] - sigmas[k + 1]), case["std"])  # τ_k of flowalign's Flow-GRPO step


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


BRANCHED = ("trainer.name=tempflow_grpo", "trainer.num_steps=5", "trainer.branch_steps=[1, 3]",
            "trainer.group_size=3", "trainer.batch_size=3", "trainer.beta=0")


def test_every_step_branches_one_shared_trajectory_at_every_candidate(tmp_path, tiny_sd3_dir, prompt_file):
    """Per prompt group: group_size branches at each candidate step, all from the group's one ODE path
    (x_T … x_k the same for every branch of every step), each with its own noise at k; advantages normalised
    per (prompt, step); on-policy the surrogate is −w_k·A."""
    t = build_trainer(small_config(tmp_path / "r", tiny_sd3_dir, prompt_file, *BRANCHED))
    batch = t.collect(0)
    adv = batch.per_chunk(batch.advantages)
    by_group: dict[int, dict[int, object]] = {}
    for i, (chunk, group) in enumerate(zip(batch.chunks, batch_groups(batch))):  # one (prompt, step) group each
        (k,) = chunk.trained_steps()
        by_group.setdefault(group // 2, {})[k] = chunk  # rollout group g·|K| + i: prompt group g, step K[i]
        assert len(chunk) == 3 and torch.isnan(chunk.log_probs[:, [j for j in range(5) if j != k]]).all()
        assert not torch.allclose(chunk.latents[0, k + 1], chunk.latents[1, k + 1])  # each branch its own noise
        assert abs(float(adv[i].mean())) < 1e-5  # normalised within the (prompt, step) group
        with torch.no_grad():
            out = t.step_distribution(chunk, k, t.policy_velocity(chunk, k, True))
            per_sample, ratio, _ = t.surrogate(chunk, k, out, chunk.step(k)[2], adv[i], None)
        torch.testing.assert_close(ratio, torch.ones_like(ratio), atol=1e-5, rtol=0)  # 1 up to kernel noise
        w = noise_aware_weights(chunk.sigmas, [1, 3], "flow_grpo", 0.7)[k]
        torch.testing.assert_close(per_sample, -w * ratio * adv[i])
    assert sorted(by_group) == [0, 1] and all(sorted(steps) == [1, 3] for steps in by_group.values())
    for steps in by_group.values():  # one trajectory: step 3's branches pass through step 1's x_1
        early, late = steps[1], steps[3]
        path = late.latents[:1, :4]
        torch.testing.assert_close(late.latents[:, :4], path.expand_as(late.latents[:, :4]), atol=1e-6, rtol=0)
        torch.testing.assert_close(early.latents[:, :2], path[:, :2].expand_as(early.latents[:, :2]), atol=1e-6, rtol=0)
    assert "branch_step" not in batch.logs


def test_every_step_on_two_ranks_is_the_single_process_batch(tmp_path, tiny_sd3_dir, prompt_file):
    """Rank 1 of 2 (one prompt) rolls out the second prompt group of one process with two: the same
    branches, noise and advantages (every draw is keyed by the global group)."""
    one = build_trainer(small_config(tmp_path / "a", tiny_sd3_dir, prompt_file, *BRANCHED))
    rank = build_trainer(small_config(tmp_path / "b", tiny_sd3_dir, prompt_file, *BRANCHED,
                                      "trainer.prompts_per_step=1"))
    rank.rank, rank.world = 1, 2
    whole, half = one.collect(0), rank.collect(0)
    mine = [i for i, g in enumerate(batch_groups(whole)) if g // 2 == 1]
    assert len(mine) == 2 and batch_groups(half) == [batch_groups(whole)[i] for i in mine]
    for j, i in enumerate(mine):
        # the shared ODE paths are integrated two to a batch in one process, alone on rank 1: CPU kernels round
        # the last bits by batch size (~1e-6 a step)
        torch.testing.assert_close(half.chunks[j].latents, whole.chunks[i].latents, atol=5e-6, rtol=0)
        torch.testing.assert_close(half.per_chunk(half.advantages)[j], whole.per_chunk(whole.advantages)[i],
                                   atol=1e-4, rtol=1e-4)


def _count_transformer_rows(trainer) -> list[int]:
    """Rows of every transformer forward from now on (a CFG pass counts both halves)."""
    rows: list[int] = []
    transformer = trainer.policy.transformer
    transformer.register_forward_pre_hook(lambda module, args, kwargs: rows.append(
        (args[0] if args else kwargs["hidden_states"]).shape[0]), with_kwargs=True)
    return rows


@pytest.mark.parametrize("branching", ["every_step", "one_step"])
def test_a_shared_ode_prefix_is_integrated_once_and_gives_the_recomputed_branches(tmp_path, tiny_sd3_dir, prompt_file,
                                                                                branching):
    """``ode_prefix: shared`` (the authors'): each trajectory's ODE path is integrated once and its branches start
    at their branching step's state; the branches are those ``recomputed`` draws (states, log-probs, noise,
    advantages up to kernel rounding) for k transformer passes fewer a branch."""
    extra = (*BRANCHED, f"trainer.branching={branching}", "trainer.prompts_per_step=2")
    shared = build_trainer(small_config(tmp_path / "a", tiny_sd3_dir, prompt_file, *extra))
    recomputed = build_trainer(small_config(tmp_path / "b", tiny_sd3_dir, prompt_file, *extra,
                                            "trainer.ode_prefix=recomputed"))
    rows_shared, rows_recomputed = _count_transformer_rows(shared), _count_transformer_rows(recomputed)
    a, b = shared.collect(0), recomputed.collect(0)
    assert batch_groups(a) == batch_groups(b)
    for x, y in zip(a.chunks, b.chunks):
        assert x.trained_steps() == y.trained_steps()
        torch.testing.assert_close(x.latents, y.latents, atol=1e-5, rtol=0)
        torch.testing.assert_close(x.log_probs, y.log_probs, atol=1e-4, rtol=1e-5, equal_nan=True)
    torch.testing.assert_close(a.advantages, b.advantages, atol=1e-3, rtol=0)
    cfg_rows = 2  # the tiny model's CFG runs both halves in one pass
    samples = sum(len(c) for c in b.chunks)
    assert sum(rows_recomputed) == cfg_rows * 5 * samples  # every branch from x_T: T = 5 steps
    skipped = sum(len(c) * c.trained_steps()[0] for c in a.chunks)  # each branch skips the k steps before k
    trunks = cfg_rows * 5 * 2  # one ODE path per trajectory: 2 prompts, T steps
    assert sum(rows_shared) == sum(rows_recomputed) - cfg_rows * skipped + trunks < sum(rows_recomputed)


def batch_groups(batch) -> list[int]:
    """The rollout group of each chunk."""
    return [int(ids[0]) for ids in batch.per_chunk(batch.groups)]


def test_one_step_groups_branch_at_one_chosen_step_from_a_shared_ode_prefix(tmp_path, tiny_sd3_dir, prompt_file):
    t = build_trainer(small_config(tmp_path / "r", tiny_sd3_dir, prompt_file, "trainer.name=tempflow_grpo",
                                   "trainer.branching=one_step", "trainer.num_steps=5", "trainer.branch_steps=[1, 3]",
                                   "trainer.prompts_per_step=4", "trainer.beta=0"))
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
    assert "branch_step" in batch.logs
    again = build_trainer(small_config(tmp_path / "s", tiny_sd3_dir, prompt_file, "trainer.name=tempflow_grpo",
                                       "trainer.branching=one_step", "trainer.num_steps=5",
                                       "trainer.branch_steps=[1, 3]", "trainer.prompts_per_step=4"))
    assert [again.branch_step(g) for g in range(4)] == [t.branch_step(g) for g in range(4)]  # keyed, not random
    assert len({t.branch_step(g) for g in range(16)}) == 2  # both candidates drawn


def test_every_step_without_a_seed_group_is_refused(tmp_path, tiny_sd3_dir, prompt_file):
    with pytest.raises(UserError, match="trainer.shared_initial_noise"):
        build_trainer(small_config(tmp_path / "r", tiny_sd3_dir, prompt_file, "trainer.name=tempflow_grpo",
                                   "trainer.shared_initial_noise=false"))


@pytest.mark.parametrize("branching", ["every_step", "one_step"])
def test_trains_and_resumes_bit_exactly(tmp_path, tiny_sd3_dir, prompt_file, branching):
    assert_trains_and_resumes_bit_exactly(tmp_path, tiny_sd3_dir, prompt_file, "trainer.name=tempflow_grpo",
                                          f"trainer.branching={branching}", "trainer.updates_per_epoch=2",
                                          "trainer.batch_size=2", "trainer.num_steps=3", "trainer.beta=0.01")


@pytest.mark.parametrize("key", ["sde_window", "sde_last_step", "timestep_fraction", "steps_per_chunk", "cps_log_prob"])
def test_settings_of_flow_grpos_steps_are_not_tempflows(key):
    """The branching steps are the only SDE steps and the only ones trained, and the sampler is never CPS:
    Flow-GRPO's settings of its steps are refused, naming them."""
    with pytest.raises(UserError, match=f"trainer.{key}: tempflow_grpo has no such setting"):
        trainer_config({"name": "tempflow_grpo", key: 1})
