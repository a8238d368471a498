"""DiffusionNFT (the baseline of docs/methods/diffusion_opsd.md): its loss and a short real run."""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator

from flowalign import checkpoint as ckpt
from flowalign.config import validate_section
from flowalign.data import read_prompt_file
from flowalign.errors import UserError
from flowalign.protocols import Conditioning
from flowalign.reward_set import RewardScores
from flowalign.sampling import Rollout
from flowalign.train import build_trainer
from flowalign.trainers import diffusion_nft
from flowalign.trainers.base import StepBatch
from flowalign.trainers.diffusion_nft import DiffusionNFTConfig, DiffusionNFTTrainer, drawn_timesteps
from flowalign.trainers.diffusion_opsd import opsd_loss
from flowalign.trainers.parts.sample_parts import sample_keys, sample_parts
from flowalign.trainers.parts.negative_aware import nft_loss, reward_weight
from flowalign.trainers.self_distill import behaviour_lambda

from .conftest import small_config
from .resume_check import assert_trains_and_resumes_bit_exactly

KNOWN = json.loads((Path(__file__).parent / "known_answers" / "diffusion_nft_loss.json").read_text())
#: the authors' optimisation schedule: return_decay, and their training loop's split of a batch over
#: gradient_step_per_epoch optimiser steps with the behaviour refresh, on a toy linear velocity
SCHEDULE = json.loads((Path(__file__).parent / "known_answers" / "diffusion_nft_schedule.json").read_text())


def _noised(x0: torch.Tensor, eps: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    t = t.view(-1, *([1] * (x0.ndim - 1)))
    return (1 - t) * x0 + t * eps


@pytest.mark.parametrize("case", KNOWN["cases"], ids=lambda c: f"mirror_beta{c['mirror_beta']}")
def test_loss_and_gradient_equal_the_authors_train_nft_sd3(case):
    """The x0-space, per-sample-normalised loss with its KL term, value and gradient (known_answers/)."""
    x0, eps, t, v_old, v_ref = (torch.tensor(KNOWN[k], dtype=torch.float64) for k in ("x0", "noise", "t", "v_old", "v_ref"))
    v_theta = torch.tensor(KNOWN["v_theta"], dtype=torch.float64).requires_grad_(True)
    r = reward_weight(torch.tensor(KNOWN["advantages"], dtype=torch.float64), KNOWN["adv_clip_max"])
    torch.testing.assert_close(r, torch.tensor(case["r"], dtype=torch.float64), rtol=1e-12, atol=0)
    per_sample, _ = nft_loss(v_theta, v_old, _noised(x0, eps, t), x0, eps, t, r, case["mirror_beta"],
                             KNOWN["adv_clip_max"], "x0_normalised", v_ref, KNOWN["kl_beta"])
    loss = per_sample.mean()
    loss.backward()
    torch.testing.assert_close(loss.item(), case["loss"], rtol=1e-6, atol=0)
    torch.testing.assert_close(v_theta.grad, torch.tensor(case["grad_v_theta"], dtype=torch.float64), rtol=1e-6, atol=1e-12)


def test_timesteps_are_drawn_per_sample_as_the_authors_permute_them():
    """⌊0.99·10⌋ = 9 distinct timesteps per sample, a different set for different samples."""
    drawn = drawn_timesteps(6, 10, 0.99, torch.Generator().manual_seed(0))
    assert drawn.shape == (9, 6)
    assert all(len(set(drawn[:, i].tolist())) == 9 for i in range(6))
    assert len({tuple(sorted(drawn[:, i].tolist())) for i in range(6)}) > 1


@pytest.mark.parametrize("form", ["x0_normalised", "velocity"])
@pytest.mark.parametrize("beta", [1.0, 0.3])
def test_nft_gradient_vanishes_at_theta_equals_phi_and_r_half_while_opsd_does_not(beta, form):
    g = torch.Generator().manual_seed(0)
    v_phi, x0, eps, z_q, a = (torch.randn(3, 16, generator=g) for _ in range(5))
    t = torch.tensor([0.8, 0.5, 0.3])
    half = torch.full((3,), 0.5)
    v_theta = v_phi.clone().requires_grad_(True)
    nft_loss(v_theta, v_phi, _noised(x0, eps, t), x0, eps, t, half, beta, 5.0, form)[0].sum().backward()
    if beta == 1.0:  # v⁺ = v_θ and v⁻ = 2v_φ − v_θ are exact: the two halves cancel bit for bit
        assert torch.equal(v_theta.grad, torch.zeros_like(v_theta))
    else:
        torch.testing.assert_close(v_theta.grad, torch.zeros_like(v_theta), atol=1e-6, rtol=0)
    # OPSD at the same point: the targets differ from the anchor, so the gradient does not vanish
    sigma = 0.3
    y0 = z_q - sigma * v_phi
    v_theta = v_phi.clone().requires_grad_(True)
    opsd_loss(v_theta, v_phi, z_q, sigma, y0 + 0.1 * a, y0 - 0.1 * a, half, beta, 5.0)[0].sum().backward()
    assert v_theta.grad.norm() > 1e-3


@pytest.mark.parametrize("form", ["x0_normalised", "velocity"])
def test_nft_loss_moves_v_theta_toward_the_data_velocity_for_good_samples(form):
    """r = 1: the fit pulls v⁺ (= v_θ at β=1) to v = ε − x; r = 0 pushes v⁻ there, so v_θ moves away."""
    g = torch.Generator().manual_seed(1)
    v_phi, x0, eps = (torch.randn(2, 8, generator=g) for _ in range(3))
    t, target = torch.tensor([0.7, 0.4]), eps - x0
    for r_value, closer in ((1.0, True), (0.0, False)):
        v_theta = v_phi.clone().requires_grad_(True)
        nft_loss(v_theta, v_phi, _noised(x0, eps, t), x0, eps, t, torch.full((2,), r_value), 1.0, 5.0,
                 form)[0].sum().backward()
        stepped = v_phi - 0.01 * v_theta.grad
        assert (((stepped - target).norm(dim=1) < (v_phi - target).norm(dim=1)) == closer).all()


def test_real_units_at_theta_equals_phi_and_r_half_give_exactly_zero_gradient(tmp_path, tiny_sd3_dir, prompt_file):
    t = build_trainer(small_config(tmp_path / "z", tiny_sd3_dir, prompt_file, "trainer.name=diffusion_nft",
                                   "trainer.timestep_fraction=0.5"))
    prompts, metadata, groups = t.step_prompts(0)
    chunk = t.sample(prompts, metadata, groups).chunks[0]
    with t.behaviour.swapped_in():
        units = t.fit_units(chunk, torch.full((len(chunk),), 0.5), torch.ones(len(chunk), dtype=torch.bool),
                          torch.Generator().manual_seed(0))
    assert len(units) == 2  # ⌊0.5·4⌋ timesteps per sample, each sample its own two
    assert all(u.tensors["t"][i] != units[1 - j].tensors["t"][i] for j, u in enumerate(units) for i in range(len(chunk)))
    for unit in units:
        loss, _ = t.fit_loss(unit)
        loss.sum().backward()
    assert all(p.grad is None or torch.equal(p.grad, torch.zeros_like(p)) for p in t.params)


def test_short_run_with_a_non_differentiable_reward_checkpoints_phi(tmp_path, tiny_sd3_dir, prompt_file):
    """NFT takes any reward (the redness function has no gradient); φ is saved with the run and
    one update with λ = 0 makes φ equal θ."""
    t = build_trainer(small_config(tmp_path / "r", tiny_sd3_dir, prompt_file, "trainer.name=diffusion_nft",
                                   "trainer.timestep_fraction=0.5", "trainer.behaviour_rate=0",
                                   "run.checkpoint_every=1"))
    before = [p.detach().clone() for p in t.params]
    t.train()
    assert any(not torch.equal(b, p) for b, p in zip(before, t.params))
    assert all(torch.equal(phi, p.detach()) for phi, p in zip(t.behaviour.tensors, t.params))
    saved = ckpt.load_checkpoint(ckpt.latest_checkpoint(tmp_path / "r"))["trainable"]
    live = t.trainable_state()
    assert set(live) == set(saved) and any(k.startswith("behaviour.") for k in saved)
    assert all(torch.equal(saved[k], v.detach().cpu()) for k, v in live.items())


@pytest.mark.parametrize("fit_guidance", [None, 1.0])
def test_fit_guidance_one_fits_the_conditional_velocity_alone(tmp_path, tiny_sd3_dir, prompt_file, fit_guidance):
    """``trainer.fit_guidance=1`` (the default): the fit never sees the CFG negatives (its v_θ and v_φ are the
    conditional velocity, whose flow-matching target ε − x_i is); null: it fits the rollout's guided velocity."""
    extra = ["trainer.name=diffusion_nft", "trainer.timestep_fraction=0.25"]
    if fit_guidance is None:  # 1.0 is the default
        extra.append("trainer.fit_guidance=null")
    t = build_trainer(small_config(tmp_path / "g", tiny_sd3_dir, prompt_file, *extra))
    prompts, metadata, groups = t.step_prompts(0)
    chunk = t.sample(prompts, metadata, groups).chunks[0]
    assert chunk.guidance_scale > 1  # the rollout itself is guided either way
    r = torch.linspace(0, 1, len(chunk))

    def fit_loss() -> torch.Tensor:
        with t.behaviour.swapped_in():
            units = t.fit_units(chunk, r, torch.ones(len(chunk), dtype=torch.bool), torch.Generator().manual_seed(0))
        with torch.no_grad():
            return torch.stack([t.fit_loss(u)[0] for u in units])

    before = fit_loss()
    for key in ("negative_prompt_embeds", "negative_pooled_prompt_embeds"):
        chunk.cond.tensors[key] = chunk.cond.tensors[key] + 1.0
    after = fit_loss()
    assert torch.equal(before, after) == (fit_guidance == 1.0)


# ---------------------------------------------------------------------------------------------- schedule


@pytest.mark.parametrize("decay_type", ["0", "1", "2"])
def test_behaviour_lambda_equals_the_authors_return_decay(decay_type):
    """λ_s of every step 0-300 for the authors' three decay types (2: flat for 75 steps, then 0.0075 per step up
    to 0.999), from behaviour_rate / behaviour_max / behaviour_flat."""
    known = SCHEDULE["return_decay"]
    c = known["decay_type_constants"][decay_type]
    ours = [behaviour_lambda(s, c["rate"], c["cap"], c["flat"]) for s in known["steps"]]
    torch.testing.assert_close(torch.tensor(ours, dtype=torch.float64),
                               torch.tensor(known["decay"][decay_type], dtype=torch.float64), rtol=1e-12, atol=0)


def test_sample_parts_are_the_authors_shuffled_disjoint_parts():
    """The authors' loop steps once per half of their shuffled batch: the same samples per step here, given
    the same permutation draw."""
    loop = SCHEDULE["loop"]
    n, parts = loop["inputs"]["n"], loop["inputs"]["gradient_step_per_epoch"]
    keys = sample_keys(torch.arange(n) // 4)  # two groups of four, in batch order
    for drawn, epoch in zip(loop["inputs"]["epochs"], loop["epochs"]):
        # theirs: n/2 samples in micro-batches of 2, 3 timesteps each, then an optimiser step
        assert epoch["backwards_per_step"] == [n // parts // loop["inputs"]["train_batch_size"] * 3] * parts
        part = sample_parts(keys, keys, parts, torch.Generator().manual_seed(drawn["perm_seed"]))
        assert [sorted((part == k).nonzero().flatten().tolist()) for k in range(parts)] == epoch["step_samples"]


def test_sample_parts_do_not_depend_on_the_rank_layout():
    """Samples spread over 1, 2 or 4 ranks, in any local order, land in the same parts of equal size."""
    keys = sample_keys(torch.tensor([3, 3, 3, 0, 0, 0, 5, 5, 5, 1, 1, 1]))

    def parts_by_key(ranks: int) -> dict[tuple[int, int], int]:
        found = {}
        for r in range(ranks):
            mine = keys[r::ranks].flip(0)
            part = sample_parts(mine, keys, 3, torch.Generator().manual_seed(7))
            found.update({tuple(k.tolist()): int(p) for k, p in zip(mine, part)})
        return found

    one = parts_by_key(1)
    assert sorted(list(one.values()).count(k) for k in range(3)) == [4, 4, 4]
    assert parts_by_key(2) == one and parts_by_key(4) == one


class ToyLinearFlow:
    """The velocity the known answers were computed with: ``v = x·(0.5 − t) + x Wᵀ + b`` (W, b trained, the
    "adapter"; disabled: the base alone), float64."""

    family, is_video = "toy", False
    device, dtype = torch.device("cpu"), torch.float64

    def __init__(self, W: torch.Tensor, b: torch.Tensor):
        self.trainable = torch.nn.Module()
        self.trainable.W = torch.nn.Parameter(W.clone())
        self.trainable.b = torch.nn.Parameter(b.clone())
        self.disabled = False

    def velocity(self, x, sigma, cond, guidance):
        v = x * (0.5 - sigma.view(-1, 1))
        return v if self.disabled else v + x @ self.trainable.W.T + self.trainable.b

    @contextmanager
    def adapter_disabled(self):
        self.disabled = True
        try:
            yield
        finally:
            self.disabled = False


def _toy_batch(epoch: dict, sigmas: torch.Tensor, chunk: int) -> StepBatch:
    x0 = torch.tensor(epoch["x0"], dtype=torch.float64)
    n, steps = x0.shape[0], len(sigmas) - 1
    chunks = []
    for s in range(0, n, chunk):
        latents = torch.zeros(chunk, steps + 1, x0.shape[1], dtype=torch.float64)
        latents[:, -1] = x0[s:s + chunk]
        prompts = [f"p{s}"] * chunk
        chunks.append(Rollout(prompts, [{}] * chunk, latents, sigmas, torch.zeros(chunk, steps),
                              torch.zeros(steps, dtype=torch.bool), None,
                              Conditioning({"dummy": torch.zeros(chunk, 1)}, prompts)))
    scores = RewardScores(torch.zeros(n, 1), torch.ones(n, 1, dtype=torch.bool), torch.ones(1), ["toy"])
    return StepBatch(chunks, torch.arange(n) // chunk, torch.arange(n) // chunk, scores,
                     torch.tensor(epoch["advantages"], dtype=torch.float64))


@pytest.mark.parametrize("fit_split", ["shuffled_parts", "whole_batch"])
def test_two_fit_steps_and_the_flat_refresh_end_at_the_authors_weights(tmp_path, tiny_sd3_dir, prompt_file,
                                                                       monkeypatch, fit_split):
    """Two outer iterations of the authors' loop (OCR form: two optimiser steps per batch, decay_type 2 from
    optimiser step 140) on a toy linear velocity, the same draws fed to both: θ and φ after each iteration
    equal theirs with ``shuffled_parts``; ``whole_batch`` (two steps over every sample) ends elsewhere."""
    loop = SCHEDULE["loop"]
    inp = loop["inputs"]
    const = SCHEDULE["return_decay"]["decay_type_constants"][str(inp["decay_type"])]
    cfg = small_config(tmp_path / "run", tiny_sd3_dir, prompt_file, "trainer.name=diffusion_nft")
    tcfg = validate_section(DiffusionNFTConfig, {
        "name": "diffusion_nft", "lr": inp["lr"], "weight_decay": inp["weight_decay"], "grad_clip": inp["max_grad_norm"],
        "prompts_per_step": 2, "group_size": 4, "batch_size": 4, "num_steps": len(inp["sigmas"]) - 1,
        "mirror_beta": inp["mirror_beta"], "adv_clip": inp["adv_clip"], "beta": inp["kl_beta"],
        "timestep_fraction": inp["timestep_fraction"], "fit_steps": inp["gradient_step_per_epoch"],
        "fit_split": fit_split, "behaviour_rate": const["rate"], "behaviour_max": const["cap"],
        "behaviour_flat": const["flat"]}, "trainer.")
    policy = ToyLinearFlow(torch.tensor(inp["W"], dtype=torch.float64), torch.tensor(inp["b"], dtype=torch.float64))
    t = DiffusionNFTTrainer(cfg, tcfg, policy, [], read_prompt_file(prompt_file), None, Accelerator(cpu=True),
                            tmp_path / "run")
    t.optimizer_steps = inp["start_step"]
    sigmas = torch.tensor(inp["sigmas"], dtype=torch.float64)
    matched = []
    for epoch_in, epoch_out in zip(inp["epochs"], loop["epochs"]):
        order, noise = torch.tensor(epoch_in["time_order"]), torch.tensor(epoch_in["noise"], dtype=torch.float64)
        starts = iter(range(0, inp["n"], 4))

        def stored_draws(shape, num_timesteps, fraction, generator, starts=starts, order=order, noise=noise):
            s = next(starts)  # chunk by chunk, in batch order
            n = int(num_timesteps * fraction)
            return order[s:s + shape[0], :n].T, noise[s:s + shape[0]].transpose(0, 1)

        monkeypatch.setattr(diffusion_nft, "forward_draws", stored_draws)
        logs = t.update(_toy_batch(epoch_in, sigmas, 4), torch.Generator().manual_seed(epoch_in["perm_seed"]))
        assert logs["behaviour_lambda"] == pytest.approx(epoch_out["decay"], rel=1e-12)
        assert t.optimizer_steps == epoch_out["global_step"]
        ours = [policy.trainable.W, policy.trainable.b, *t.behaviour.tensors]
        theirs = [torch.tensor(epoch_out[k], dtype=torch.float64) for k in ("W", "b", "W_old", "b_old")]
        matched.append(all(torch.allclose(a.detach(), b, rtol=1e-6, atol=1e-12) for a, b in zip(ours, theirs)))
        if fit_split == "shuffled_parts":
            for a, b in zip(ours, theirs):
                torch.testing.assert_close(a.detach(), b, rtol=1e-6, atol=1e-12)
    assert all(matched) == (fit_split == "shuffled_parts")


def test_real_fit_steps_take_disjoint_halves_of_every_rollout(tmp_path, tiny_sd3_dir, prompt_file):
    """On the tiny model: each sample is trained in exactly one of the two steps, at all of its drawn
    timesteps, and each step's mean runs over its own (sample, timestep) pairs."""
    t = build_trainer(small_config(tmp_path / "p", tiny_sd3_dir, prompt_file, "trainer.name=diffusion_nft",
                                   "trainer.timestep_fraction=0.5", "trainer.fit_steps=2"))
    prompts, metadata, groups = t.step_prompts(0)
    batch = t.sample(prompts, metadata, groups)
    n = len(batch.groups)
    batch.scores = RewardScores(torch.zeros(n, 1), torch.ones(n, 1, dtype=torch.bool), torch.ones(1), ["toy"])
    batch.advantages = torch.linspace(-1, 1, n)
    plan = t.plan(batch, torch.Generator().manual_seed(0))
    assert len(plan.steps) == 2
    seen = []
    for step in plan.steps:
        latents = torch.cat([u.chunk.final_latents for u in step])
        rows = {tuple(x.flatten()[:4].tolist()) for x in latents}
        assert len(rows) == n // 2 and len(latents) == 2 * (n // 2)  # ⌊0.5·4⌋ timesteps per sample
        assert all(u.total == 2 * (n // 2) for u in step)
        seen.append(rows)
    assert not seen[0] & seen[1]
    whole = build_trainer(small_config(tmp_path / "w", tiny_sd3_dir, prompt_file, "trainer.name=diffusion_nft",
                                       "trainer.timestep_fraction=0.5", "trainer.fit_steps=2",
                                       "trainer.fit_split=whole_batch"))
    steps = whole.plan(batch, torch.Generator().manual_seed(0)).steps
    assert [sum(len(u.chunk) for u in s) for s in steps] == [2 * n, 2 * n] and steps[0][0].total == 2 * n


def test_filler_runs_the_training_forward_with_a_finite_loss(tmp_path, tiny_sd3_dir, prompt_file):
    """The unit a sharded rank with no sample in a step's part runs: a finite loss that backpropagates."""
    t = build_trainer(small_config(tmp_path / "f", tiny_sd3_dir, prompt_file, "trainer.name=diffusion_nft",
                                   "trainer.timestep_fraction=0.5", "trainer.fit_steps=2"))
    prompts, metadata, groups = t.step_prompts(0)
    batch = t.sample(prompts, metadata, groups)
    loss, _ = t.loss(batch, t.filler(batch, 1))
    assert torch.isfinite(loss)
    (loss * 0).backward()
    assert any(p.grad is not None for p in t.params)


def test_more_fit_steps_than_samples_is_refused_naming_the_fix(tmp_path, tiny_sd3_dir, prompt_file):
    with pytest.raises((UserError, ValueError), match=r"trainer\.fit_steps=9 parts .*trainer\.fit_split=whole_batch"):
        build_trainer(small_config(tmp_path / "x", tiny_sd3_dir, prompt_file, "trainer.name=diffusion_nft",
                                   "trainer.fit_steps=9", "trainer.prompts_per_step=1", "trainer.group_size=4"))


NFT_PARTS = ("trainer.name=diffusion_nft", "trainer.timestep_fraction=0.5", "trainer.fit_steps=2",
             "trainer.behaviour_flat=1", "trainer.behaviour_rate=0.3")


def test_shuffled_parts_and_a_flat_refresh_resume_bit_exactly(tmp_path, tiny_sd3_dir, prompt_file):
    assert_trains_and_resumes_bit_exactly(tmp_path, tiny_sd3_dir, prompt_file, *NFT_PARTS)
