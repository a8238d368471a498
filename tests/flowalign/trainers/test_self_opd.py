"""Self-OPD: the self-reference advantages, the pull-push objective and its attenuation, the authors' weights,
loss, step draw, mask of flat trunks and re-adding of dropped ones as known answers (known_answers/self_opd_*.json), K = 1, the SDE trunks
and their deterministic branches (and the former ODE trunk as its own baseline) on the tiny model, learning on
a toy flow, and bit-exact resume (docs/methods/self_opd.md)."""

import json
import math
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator

from flowalign.config import load_config, validate_section
from flowalign.data import read_prompt_file
from flowalign.protocols import RewardOutput
from flowalign.sampling import continue_ode, euler_step, gaussian_log_prob, rollout
from flowalign.train import build_trainer
from flowalign.trainers.base import derived_seed
from flowalign.trainers.self_opd import (
    SelfOPDConfig,
    SelfOPDTrainer,
    branched_step_draw,
    differs_from_its_prompt,
    pull_push_loss,
    pull_push_weights,
    readd_dropped,
    self_reference_advantages,
)

from .conftest import REPO, small_config
from .resume_check import assert_trains_and_resumes_bit_exactly
from .toy_latent import BiasedGaussianPolicy

ALL = torch.ones(3, dtype=torch.bool)


KNOWN = json.loads((Path(__file__).parent / "known_answers" / "self_opd_branch_loss.json").read_text())
DRAWS = json.loads((Path(__file__).parent / "known_answers" / "self_opd_step_draw.json").read_text())
MASKS = json.loads((Path(__file__).parent / "known_answers" / "self_opd_flat_mask.json").read_text())
READD = json.loads((Path(__file__).parent / "known_answers" / "self_opd_readd.json").read_text())
#: the trunk before the authors' (one ODE rollout a prompt, every trunk branched)
ODE_TRUNK = ("trainer.trunks=1", "trainer.trunk_noise_level=0", "trainer.drop_flat=false")


@pytest.mark.parametrize("case", KNOWN["cases"], ids=lambda c: f"aware{c['direction_aware']}-clip{c['branch_weight_clip']}")
def test_weights_loss_and_gradient_equal_the_authors_select_all_branches(case):
    """Per prompt: the advantages, the direction-aware clipped weights and the per-branch regression; the
    authors' loss is the mean over prompts and branches, flowalign's one unit per prompt."""
    f64 = lambda x: torch.tensor(x, dtype=torch.float64)
    mu = f64(KNOWN["mu_theta"]).requires_grad_(True)
    branches, names = f64(KNOWN["branches"]), list(KNOWN["per_scorer"])
    values = torch.stack([f64(KNOWN["per_scorer"][n]) for n in names], dim=-1)  # (B, K, M)
    base = torch.stack([f64(KNOWN["ode_per_scorer"][n]) for n in names], dim=-1)  # (B, M)
    w = f64([KNOWN["score_weights"][n] for n in names])
    tau = KNOWN["std_dev_t"] * math.sqrt(KNOWN["abs_dt"])
    losses = []
    for b in range(len(mu)):
        valid = torch.ones(values.shape[1], dtype=torch.bool)
        adv = self_reference_advantages(values[b], valid, base[b], True, w)
        torch.testing.assert_close(adv, f64(case["advantages"][b]), rtol=1e-6, atol=1e-12)
        weights = pull_push_weights(adv, branches[b] - mu[b : b + 1].detach(), case["direction_aware"],
                                    case["branch_weight_clip"])
        torch.testing.assert_close(weights, f64(case["weights"][b]), rtol=1e-6, atol=1e-12)
        losses.append(pull_push_loss(mu[b : b + 1], branches[b], tau, weights))
    loss = torch.stack(losses).mean()
    loss.backward()
    torch.testing.assert_close(loss.item(), case["loss"], rtol=1e-6, atol=0)
    torch.testing.assert_close(mu.grad, f64(case["grad_mu_theta"]), rtol=1e-6, atol=1e-12)


def test_the_branched_steps_are_drawn_with_the_authors_odds():
    """The same generator seeds draw the same steps as the authors' ``torch.multinomial`` over their weights."""
    high = min(DRAWS["num_steps"] - 1, int(DRAWS["num_steps"] * DRAWS["timestep_fraction"]))
    assert SelfOPDConfig(name="self_opd").step_weights == DRAWS["timestep_weights"]
    for d in DRAWS["draws"]:
        drawn = branched_step_draw(high, DRAWS["timesteps_per_step"], DRAWS["timestep_weights"],
                                   torch.Generator().manual_seed(d["seed"]))
        assert drawn == d["train_timesteps"]
    # a zero weight is never drawn; with fewer positive weights than asked, only those
    assert branched_step_draw(4, 3, [0.0, 1.0, 0.0, 2.0], torch.Generator().manual_seed(0)) == [1, 3]
    assert len(branched_step_draw(5, 3, [], torch.Generator().manual_seed(0))) == 3


def test_advantages_are_measured_from_the_deterministic_branch():
    values, base, w = torch.tensor([[0.7], [0.5], [0.2]]), torch.tensor([0.5]), torch.tensor([1.0])
    adv = self_reference_advantages(values, ALL, base, True, w, eps=0.0)
    d = torch.tensor([0.2, 0.0, -0.3])
    torch.testing.assert_close(adv, d / values[:, 0].std())
    assert adv[1] == 0  # as good as the baseline: no signal, even though it is above the branches' mean
    # a constant added to every reward (baseline included) changes nothing; moving the baseline alone does
    torch.testing.assert_close(self_reference_advantages(values + 3, ALL, base + 3, True, w, eps=0.0), adv)
    moved = self_reference_advantages(values, ALL, torch.tensor([0.2]), True, w, eps=0.0)
    assert moved[2] == 0 and (moved[:2] > 0).all()
    # without a valid baseline nothing is compared; an invalid branch gets 0 and leaves the scale alone
    assert torch.equal(self_reference_advantages(values, ALL, base, False, w), torch.zeros(3))
    valid = torch.tensor([True, True, False])
    part = self_reference_advantages(values, valid, base, True, w, eps=0.0)
    assert part[2] == 0 and part[0] == pytest.approx(0.2 / values[:2, 0].std().item())
    # equal candidates: the spread is floored at eps instead of dividing by 0
    flat = self_reference_advantages(torch.full((3, 1), 0.6), ALL, base, True, w, eps=1e-4)
    torch.testing.assert_close(flat, torch.full((3,), 0.1 / 1e-4))


def test_rewards_are_fused_by_their_weights_before_they_are_scaled():
    """The authors fuse the rewards first: the advantage of M rewards is that of their weighted sum, and a
    common scale of all rewards cancels."""
    values = torch.tensor([[1.0, 0.5], [0.0, -0.2], [-1.0, 0.3]])
    base, w = torch.tensor([0.2, 0.1]), torch.tensor([1.0, 0.5])
    fused = self_reference_advantages(values, ALL, base, True, w, eps=0.0)
    one = self_reference_advantages((values @ w)[:, None], ALL, (base @ w)[None], True, torch.ones(1), eps=0.0)
    torch.testing.assert_close(fused, one)
    torch.testing.assert_close(self_reference_advantages(values * 7, ALL, base * 7, True, w, eps=0.0), fused)


def _grad_of_mean(mean_old, branches, std, weights):
    mean = mean_old.clone().requires_grad_(True)
    pull_push_loss(mean, branches, std, weights).backward()
    return mean.grad


def test_the_pull_push_sign_follows_the_advantage():
    """One gradient step on μ moves it toward a branch of positive advantage and away from one of negative."""
    torch.manual_seed(0)
    mean_old, std = torch.zeros(1, 16), 0.3
    branch = mean_old + std * torch.randn(1, 16)
    for a in (1.5, -0.7):
        g = _grad_of_mean(mean_old, branch, std, torch.tensor([a]))
        stepped = mean_old - 1e-2 * g
        closer = (stepped - branch).norm() < (mean_old - branch).norm()
        assert closer == (a > 0)
        # SDE-variance normalisation: the gradient is −A·ξ/(τ·D), so its size does not grow as τ shrinks
        xi = (branch - mean_old) / std
        torch.testing.assert_close(g, -a * xi / (std * 16))


def test_a_branch_with_zero_advantage_contributes_nothing():
    torch.manual_seed(1)
    mean_old, std = torch.zeros(1, 8), 0.5
    branches = mean_old + std * torch.randn(3, 8)
    adv = torch.tensor([1.0, 0.0, -1.0])
    g = _grad_of_mean(mean_old, branches, std, pull_push_weights(adv, branches - mean_old))
    moved = branches.clone()
    moved[1] = torch.randn(8) * 10  # wherever the zero-advantage branch lies
    assert torch.equal(g, _grad_of_mean(mean_old, moved, std, pull_push_weights(adv, moved - mean_old)))


def test_pushes_are_attenuated_by_their_agreement_with_the_best_branch():
    """ω = A for pulls, A·(1 − cos(δ, δ_best))/2 for pushes, then clipped to ±1 (the authors' defaults)."""
    e1, e2 = torch.eye(2)
    offsets = torch.stack([e1, e1, -e1, e2, (e1 + e2) / math.sqrt(2)])
    adv = torch.tensor([0.8, -1.0, -1.0, -1.0, -1.0])
    w = pull_push_weights(adv, offsets)
    torch.testing.assert_close(w, torch.tensor([0.8, 0.0, -1.0, -0.5, -(1 - 1 / math.sqrt(2)) / 2]))
    assert torch.equal(pull_push_weights(adv, offsets, attenuate=False), adv)
    # weights are clipped, after the attenuation
    torch.testing.assert_close(pull_push_weights(adv * 3, offsets), torch.tensor([1.0, 0.0, -1.0, -1.0, -0.4393398]))
    # no winner: the least bad branch is the best, and pushes along it are attenuated all the same
    losers = torch.tensor([-0.2, -0.5])
    torch.testing.assert_close(pull_push_weights(losers, offsets[[0, 2]]), torch.tensor([0.0, -0.5]))


def test_one_branch_pulls_a_winner_and_leaves_a_loser_alone():
    """K = 1: the spread is 0, so A = ΔR/ε, clipped to ω = 1 for a winner (the Gaussian likelihood of the
    candidate is maximised: distillation toward it); a loser is its own best branch and gets ω = 0."""
    base, w = torch.tensor([0.0]), torch.tensor([1.0])
    for reward, expected in ((0.3, 1.0), (-0.01, 0.0)):
        adv = self_reference_advantages(torch.tensor([[reward]]), torch.ones(1, dtype=torch.bool), base, True, w)
        assert adv.item() == pytest.approx(reward / 1e-4)
        torch.manual_seed(2)
        mean_old, std = torch.zeros(1, 6), 0.4
        branch = mean_old + std * torch.randn(1, 6)
        weights = pull_push_weights(adv, branch - mean_old)
        assert weights.item() == pytest.approx(expected, abs=1e-4)  # cos(δ, δ) = 1 up to rounding
        g = _grad_of_mean(mean_old, branch, std, weights)
        mean = mean_old.clone().requires_grad_(True)
        (-gaussian_log_prob(branch, mean, torch.tensor(std))).sum().backward()
        torch.testing.assert_close(g, weights * mean.grad)


@pytest.mark.parametrize("case", MASKS["cases"], ids=lambda c: "-".join(sorted(set(c["prompts"]))))
def test_the_flat_trunks_dropped_are_the_authors_zero_advantage_samples(case):
    ids = {p: i for i, p in enumerate(sorted(set(case["prompts"])))}
    prompt_ids = torch.tensor([ids[p] for p in case["prompts"]])
    rewards = torch.tensor(case["rewards"], dtype=torch.float32)
    valid = torch.ones(len(rewards), dtype=torch.bool)
    assert differs_from_its_prompt(rewards, valid, prompt_ids).tolist() == case["kept"]
    # an invalid trunk is dropped and leaves its prompt's mean to the valid ones
    valid[0] = False
    kept = differs_from_its_prompt(rewards, valid, prompt_ids)
    assert not kept[0] and kept[1:].tolist() == differs_from_its_prompt(rewards[1:], valid[1:], prompt_ids[1:]).tolist()


@pytest.mark.parametrize("case", READD["cases"],
                         ids=lambda c: f"n{len(c['kept'])}-kept{sum(c['kept'])}-nb{c['num_batches_per_epoch']}-seed{c['seed']}")
def test_the_dropped_trunks_readded_are_the_authors_draw(case):
    """Their re-balancing after the mask, driven with the global RNG seeded as our generator: the same samples
    re-added (their draw's source is their global RNG; ours a generator keyed by (seed, step))."""
    kept = torch.tensor(case["kept"])
    out = readd_dropped(kept, case["num_batches_per_epoch"], torch.Generator().manual_seed(case["seed"]))
    assert out.tolist() == (case["kept"] if case["after"] is None else case["after"])
    assert torch.equal(kept, torch.tensor(case["kept"]))  # the mask given is left as it was


def test_dropping_flat_trunks_needs_more_than_one_a_prompt():
    with pytest.raises(Exception, match="trainer.trunks=1"):
        validate_section(SelfOPDConfig, {"name": "self_opd", "trunks": 1}, "trainer.")
    validate_section(SelfOPDConfig, {"name": "self_opd", "trunks": 1, "drop_flat": False}, "trainer.")


def test_sde_trunks_are_branched_against_their_own_deterministic_step(tmp_path, tiny_sd3_dir, prompt_file):
    """The authors' form: each prompt's trunks are Flow-GRPO SDE rollouts (the last step too), and the baseline of
    a branched state is the ODE step from it finished by the ODE, not the trunk's own sample."""
    t = build_trainer(small_config(tmp_path / "r", tiny_sd3_dir, prompt_file, "trainer.name=self_opd",
                                   "trainer.trunks=2", "trainer.branches=2", "trainer.branch_steps=1",
                                   "trainer.drop_flat=false"))
    batch = t.collect(0)
    trunk, (k,) = batch.trunk, t.branched_steps(0)
    assert len(trunk.groups) == 2 * 2 and len(batch.sets) == 4 and batch.logs["trunk/kept_fraction"] == 1.0
    members = [int((trunk.groups[:m] == g).sum()) for m, g in enumerate(trunk.groups)]
    generators = [torch.Generator().manual_seed(derived_seed(t.cfg.run.seed, 0, int(g), m, 5))
                  for g, m in zip(trunk.groups, members)]
    sde = rollout(t.policy, trunk.prompts, num_steps=t.tcfg.num_steps, sampler="flow_grpo", noise_level=0.7,
                  sde_last_step=True, generators=generators)
    torch.testing.assert_close(trunk.chunks[0].final_latents, sde.final_latents, atol=1e-5, rtol=0)
    bases = []
    for s in batch.sets:
        chunk = trunk.chunks[s.chunk]
        det = euler_step(chunk.velocities[s.sample : s.sample + 1, k], s.x_k, chunk.sigmas[k].item(),
                         chunk.sigmas[k + 1].item()).prev_sample
        ends = continue_ode(t.policy, torch.cat([s.branches, det]), chunk.sigmas[k + 1 :],
                            chunk.cond[[s.sample] * 3], chunk.guidance_scale)
        scores = t.rewards.score(t.policy.decode(ends), [chunk.prompts[s.sample]] * 3, [chunk.metadata[s.sample]] * 3)
        expected = self_reference_advantages(scores.values[:2], scores.valid[:2], scores.values[2], True,
                                             scores.weights, t.tcfg.adv_eps)
        torch.testing.assert_close(s.advantages, expected, atol=1e-4, rtol=1e-4)
        bases.append((scores.total[2] - trunk.scores.total[s.sample]).abs().item())
    assert max(bases) > 1e-4  # the deterministic branch is not the SDE trunk's sample: the baseline differs


def test_only_trunks_whose_reward_differs_from_their_prompts_are_branched(tmp_path, prompt_file):
    """A prompt whose trunks all score alike teaches nothing: none of its trunks is branched."""
    cfg = small_config(tmp_path / "run", tmp_path, prompt_file, "trainer.name=self_opd")
    tcfg = validate_section(SelfOPDConfig, {"name": "self_opd", "trunks": 3, "branches": 2, "branch_steps": 1,
                                            "num_steps": 4, "prompts_per_step": 4, "kept_multiple": 1}, "trainer.")

    def red_is_flat(samples, prompts, metadata):  # 0.5 for every red sample, the latents' sum for the others
        value = torch.where(torch.tensor(["red" in p for p in prompts]), 0.5, samples.sum(1))
        return RewardOutput({"r": value}, torch.ones(len(value), dtype=torch.bool))

    trainer = SelfOPDTrainer(cfg, tcfg, BiasedGaussianPolicy(dim=4), [("r", 1.0, red_is_flat)],
                             read_prompt_file(prompt_file), None, Accelerator(cpu=True), tmp_path / "run")
    batch = trainer.collect(0)
    flat = [m for m, p in enumerate(batch.trunk.prompts) if "red" in p]
    branched = {s.key[0] for s in batch.sets}
    assert flat and len(branched) == 12 - len(flat) == 9
    assert batch.logs["trunk/kept_fraction"] == pytest.approx(9 / 12)
    assert all(batch.trunk.chunks[s.chunk].prompts[s.sample] != "a red circle" for s in batch.sets)

    # the authors' re-balancing: dropped trunks re-added up to a multiple of kept_multiple, drawn by (seed, step)
    for multiple, count in ((2, 10), (4, 12), (16, 9)):  # 16: 7 wanted, 3 dropped: none re-added
        trainer.tcfg = tcfg.model_copy(update={"kept_multiple": multiple})
        batch = trainer.collect(0)
        keys = sorted({s.key[0] for s in batch.sets})
        assert len(keys) == count and batch.logs["trunk/kept_fraction"] == pytest.approx(count / 12)
        kept = torch.tensor([m not in flat for m in range(12)])
        drawn = readd_dropped(kept, multiple, torch.Generator().manual_seed(derived_seed(cfg.run.seed, 0, 31)))
        assert keys == torch.where(drawn)[0].tolist()
    # the draw is keyed by the step too: later steps re-add what their own key draws
    trainer.tcfg = tcfg.model_copy(update={"kept_multiple": 5})
    for step in (1, 2, 3):
        batch = trainer.collect(step)
        kept = torch.tensor(["red" not in p for p in batch.trunk.prompts])
        drawn = readd_dropped(kept, 5, torch.Generator().manual_seed(derived_seed(cfg.run.seed, step, 31)))
        assert sorted({s.key[0] for s in batch.sets}) == torch.where(drawn)[0].tolist()
    trainer.tcfg = tcfg

    # a step whose trunks are all flat branches nothing, and trains nothing
    trainer.rewards = [("r", 1.0, lambda samples, prompts, metadata: RewardOutput(
        {"r": torch.full((len(prompts),), 0.5)}, torch.ones(len(prompts), dtype=torch.bool)))]
    batch = trainer.collect(1)
    assert batch.sets == [] and batch.spare is None and batch.logs["trunk/kept_fraction"] == 0
    before = [p.detach().clone() for p in trainer.policy.trainable.parameters()]
    assert trainer.train_step()["trunk/kept_fraction"] == 0
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.policy.trainable.parameters()))


@pytest.fixture
def tiny_trainer(tmp_path, tiny_sd3_dir, prompt_file):
    return build_trainer(small_config(tmp_path / "r", tiny_sd3_dir, prompt_file, "trainer.name=self_opd",
                                      "trainer.branches=3", "trainer.branch_steps=2", *ODE_TRUNK))


def test_an_ode_trunk_is_its_own_baseline_and_branches_leave_its_state(tiny_trainer):
    t = tiny_trainer
    batch = t.collect(0)
    trunk = batch.trunk
    assert len(batch.sets) == 2 * t.tcfg.prompts_per_step and {s.k for s in batch.sets} <= {0, 1, 2}
    # the trunk (whose reward is the baseline) is the plain ODE sample of the same initial noise
    seeds = [derived_seed(t.cfg.run.seed, 0, g, 0, 5) for g in trunk.groups.tolist()]  # the loop's keying
    noise = torch.cat([t.policy.initial_noise(1, torch.Generator().manual_seed(s)) for s in seeds])
    plain = rollout(t.policy, trunk.prompts, num_steps=t.tcfg.num_steps, sampler="ode", initial_noise=noise)
    torch.testing.assert_close(trunk.chunks[0].final_latents, plain.final_latents, atol=1e-5, rtol=0)
    for s in batch.sets:
        chunk = trunk.chunks[s.chunk]
        assert torch.equal(s.x_k, chunk.latents[s.sample : s.sample + 1, s.k])
        # the deterministic next state, finished by the ODE, is the trunk's own sample
        det = euler_step(chunk.velocities[s.sample : s.sample + 1, s.k], s.x_k, chunk.sigmas[s.k].item(),
                         chunk.sigmas[s.k + 1].item()).prev_sample
        end = continue_ode(t.policy, det, chunk.sigmas[s.k + 1 :], chunk.cond[[s.sample]], chunk.guidance_scale)
        torch.testing.assert_close(end, chunk.final_latents[s.sample : s.sample + 1], atol=1e-5, rtol=0)
        assert s.branches.shape[0] == 3 and not torch.equal(s.branches[0], s.branches[1])
    assert (torch.cat([s.advantages for s in batch.sets]) != 0).any()


def test_trains_and_resumes_bit_exactly(tmp_path, tiny_sd3_dir, prompt_file):
    assert_trains_and_resumes_bit_exactly(tmp_path, tiny_sd3_dir, prompt_file, "trainer.name=self_opd",
                                          "trainer.branches=2", "trainer.trunks=2")


def linear_reward(samples, prompts, metadata):
    """``⟨a, x⟩`` with a = (1, −1, 0.5, 0) (the toy flow decodes to its latents)."""
    value = (samples * torch.tensor([1.0, -1.0, 0.5, 0.0])).sum(1)
    return RewardOutput({"linear": value}, torch.ones(len(value), dtype=torch.bool))


def test_on_a_toy_flow_the_velocity_moves_so_that_the_reward_rises(tmp_path, prompt_file):
    """Exact Gaussian flow with one trainable velocity offset b: increasing ⟨a, x0⟩ means b moves along −a
    (the velocity points toward the noise)."""
    cfg = small_config(tmp_path / "run", tmp_path, prompt_file, "trainer.name=self_opd")
    tcfg = validate_section(SelfOPDConfig, {"name": "self_opd", "branches": 8, "branch_steps": 3, "num_steps": 6, "trunks": 2,
                                            "prompts_per_step": 4, "lr": 3e-2, "weight_decay": 0.0,
                                            "max_step_fraction": 1.0}, "trainer.")
    policy = BiasedGaussianPolicy(dim=4)
    trainer = SelfOPDTrainer(cfg, tcfg, policy, [("linear", 1.0, linear_reward)], read_prompt_file(prompt_file),
                             None, Accelerator(cpu=True), tmp_path / "run")
    rewards = []
    for _ in range(15):
        logs = trainer.train_step()
        trainer.step += 1
        rewards.append(logs["reward/total"])
    a = torch.tensor([1.0, -1.0, 0.5, 0.0])
    b = policy.trainable.bias.detach()
    assert torch.nn.functional.cosine_similarity(b, -a, dim=0) > 0.8, b
    assert sum(rewards[-3:]) > sum(rewards[:3]) + 0.5


def test_the_tiny_recipe_trains_two_steps(tmp_path):
    recipe = REPO / "configs" / "tiny" / "self_opd_vvr.yaml"
    cfg = load_config(recipe, [f"run.output_dir={tmp_path / 'r'}", "run.progress=false", "eval.bench=null",
                               "data.n=8", "trainer.max_steps=2", "trainer.prompts_per_step=1", "trainer.num_steps=4",
                               "trainer.branches=2", "trainer.branch_steps=1"])
    trainer = build_trainer(cfg)
    trainer.train()
    assert trainer.step == 2 and (tmp_path / "r" / "checkpoints" / "step-000002").is_dir()
