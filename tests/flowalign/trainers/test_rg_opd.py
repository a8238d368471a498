"""RG-OPD and CoRe: the properties of ``docs/methods/latent_registers.md`` on a toy flow and on the tiny SD3 model."""

import json
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator
from safetensors.torch import load_file

from flowalign.config import validate_section
from flowalign.data import read_prompt_file
from flowalign.errors import UserError
from flowalign.sampling import Guidance, reward_gradient
from flowalign.sampling.guidance import combine_heads
from flowalign.train import build_trainer
from flowalign.trainers.rg_opd import (
    RGOPDConfig,
    RGOPDTrainer,
    distillation_target,
    reward_active,
    rg_opd_loss,
    transition_std,
)

from .conftest import small_config
from .toy_latent import BiasedGaussianPolicy, LinearHeadsLatentReward, LinearLatentReward

KNOWN = json.loads((Path(__file__).parent / "known_answers" / "rg_opd_target_loss.json").read_text())
NOISY = json.loads((Path(__file__).parent / "known_answers" / "rg_opd_transition_noise.json").read_text())
HEADS = json.loads((Path(__file__).parent / "known_answers" / "rg_opd_heads.json").read_text())


class FixedHeadGradients:
    """A several-head latent reward ``r_h(x) = Σ ⟨G_h, x⟩`` per sample: head h's gradient is ``G_h``."""

    def __init__(self, grads: dict[str, torch.Tensor]):
        self.grads = grads

    def score_heads(self, x, sigma, cond):
        return {h: (x * g).flatten(1).sum(1) for h, g in self.grads.items()}


@pytest.mark.parametrize("case", HEADS["cases"], ids=lambda c: f"scale{c['scale']}")
def test_two_heads_combine_into_the_authors_target(case):
    """Their ``combine`` (each head's gradient normalised, weighted, summed) then ``build_rgopd_target``: the
    combined gradient, RG-OPD's target next state, and RGS's guided step at the same scale, from the heads'
    gradients (float32, rtol 1e-5)."""
    t = lambda v: torch.tensor(v, dtype=torch.float32).reshape(HEADS["shape"])
    grads = {h: t(g) for h, g in HEADS["gradients"].items()}
    x, v_base, dt = t(HEADS["x"]), t(HEADS["v_base"]), HEADS["next_sigma"] - HEADS["sigma"]
    torch.testing.assert_close(combine_heads(grads, case["weights"]).flatten(), torch.tensor(case["combined"]),
                               rtol=1e-5, atol=1e-6)
    expected = torch.tensor(case["target_next"])
    v_star = distillation_target(v_base, grads, case["scale"], case["weights"])
    torch.testing.assert_close((x + dt * v_star).flatten(), expected, rtol=1e-5, atol=1e-5)
    guide = Guidance(FixedHeadGradients(grads), case["scale"], heads=tuple(grads), head_weights=case["weights"])
    torch.testing.assert_close((x + dt * guide(v_base, x, HEADS["sigma"], None)).flatten(), expected, rtol=1e-5, atol=1e-5)
    if case["weights"]:  # the weights matter: equal weights give another target
        assert not torch.allclose(distillation_target(v_base, grads, case["scale"]), v_star)


class ToyLatentReward:
    """The known answers' reward: ``r(x, σ) = (1 + σ)·Σ tanh(a·x) + 0.3·(x·b)²`` over the flattened sample."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor):
        self.a, self.b = a, b

    def score(self, x, sigma, cond):
        flat = x.reshape(x.shape[0], -1)
        return torch.tanh(self.a * flat).sum(1) * (1 + sigma) + 0.3 * (flat @ self.b) ** 2


def _case(case):
    shape = case["shape"]
    f64 = {k: torch.tensor(v, dtype=torch.float64) for k, v in case["inputs"].items()}
    d = f64["a"].numel()
    return (f64["x"].reshape(shape), f64["v_ref"].reshape(shape), f64["v_rollout"].reshape(shape), f64["a"], f64["b"],
            f64["W"].reshape(d, d), f64["c"], {k: torch.tensor(v, dtype=torch.float64) for k, v in case["outputs"].items()
                                                if k != "loss"})


@pytest.mark.parametrize("case", [c for c in KNOWN["cases"] if len(c["bands"]) == 1], ids=lambda c: c["name"])
def test_training_unit_matches_the_authors(case):
    """Guanys-dar/latent-reward-register (rgopd.py @ 16028b7, guidance.py @ c22b65e): the reward gradient, the
    guided target state ``x + dt·v*`` (frozen-reference base, gated below σ = 0.2 and for a gradient of rms ≤ 1e-6),
    the loss and its gradient in the student's weights, all at rtol 1e-6 in float64."""
    x, v_ref, _, a, b, w, c, out = _case(case)
    (threshold, kappa), = case["bands"]
    tcfg = validate_section(RGOPDConfig, {"name": "rg_opd", "latent_reward": "x", "kappa": kappa,
                                          "active_sigma_min": threshold}, "trainer.")
    assert (tcfg.target_base, tcfg.loss_space, tcfg.updates) == ("reference", "transition", "per_state")
    sigma, dt = case["sigma"], case["next_sigma"] - case["sigma"]
    grad, score = reward_gradient(ToyLatentReward(a, b), x, sigma, None)
    assert grad.dtype == torch.float64
    torch.testing.assert_close(score, out["score"], rtol=1e-6, atol=0)
    if case["zero_grad_sample"] is not None:  # a gradient under min_gradient_rms 1e-6 gets no correction
        grad[case["zero_grad_sample"]] *= 1e-9
    torch.testing.assert_close(grad.flatten(), out["grad"], rtol=1e-6, atol=0)
    guided = reward_active(sigma, tcfg.kappa, tcfg.active_sigma_min)
    assert guided == (case["scale_at_sigma"] > 0)
    v_star = distillation_target(v_ref, grad, tcfg.kappa) if guided else v_ref
    torch.testing.assert_close((x + dt * v_star).flatten(), out["target_next"], rtol=1e-6, atol=1e-12)
    weights = w.clone().requires_grad_(True)
    v_theta = (x.reshape(x.shape[0], -1) @ weights.T + c).reshape(x.shape)
    loss = rg_opd_loss(v_theta, v_star, dt)
    (grad_w,) = torch.autograd.grad(loss, weights)
    assert loss.item() == pytest.approx(case["outputs"]["loss"], rel=1e-6)
    torch.testing.assert_close(grad_w.flatten(), out["grad_W"], rtol=1e-6, atol=1e-12)


def test_plan_is_one_optimiser_step_per_visited_state_toward_the_reference(tmp_path, prompt_file):
    """The authors' loop on a toy flow: the first T − 1 states, one optimiser step each in trajectory order,
    targets built on the velocity the policy gives with its adapter switched off, recomputed at planning (not
    the rollout's kept velocity), uncorrected for σ ≤ active_sigma_min."""
    direction = [1.0, -2.0, 0.5, 0.0]
    reward_dir = LinearLatentReward.write(tmp_path / "linear", direction)
    cfg = small_config(tmp_path / "run", tmp_path, prompt_file, "trainer.name=rg_opd")
    tcfg = validate_section(RGOPDConfig, {"name": "rg_opd", "latent_reward": str(reward_dir), "num_steps": 6,
                                          "prompts_per_step": 2, "group_size": 4, "batch_size": 4}, "trainer.")
    policy = BiasedGaussianPolicy(dim=4)
    trainer = RGOPDTrainer(cfg, tcfg, policy, [], read_prompt_file(prompt_file), None, Accelerator(cpu=True), tmp_path / "run")
    prompts, metadata, groups = trainer.step_prompts(0)
    batch = trainer.sample(prompts, metadata, groups)
    with torch.no_grad():
        policy.trainable.bias.fill_(0.3)  # the toy's adapter switch is a no-op: the reference velocity has the bias
    steps = trainer.plan(batch, torch.Generator().manual_seed(0)).steps
    assert [sorted({u.k for u in step}) for step in steps] == [[k] for k in range(5)]
    a = torch.tensor(direction)
    for step in steps:
        for unit in step:
            chunk = batch.chunks[unit.chunk]
            sigma = chunk.sigmas[unit.k].item()
            assert unit.dt == pytest.approx(chunk.sigmas[unit.k + 1].item() - sigma)
            assert unit.of == 2  # two chunks of four samples share each state's optimiser step
            v_base = chunk.velocities[:, unit.k] + 0.3  # the rollout ran at bias 0; the policy's bias is 0.3
            shift = unit.target - v_base
            if sigma > 0.2:
                rms = v_base.pow(2).mean(1).sqrt()
                expected = -0.4 * rms[:, None] * a / a.pow(2).mean().sqrt()
                torch.testing.assert_close(shift, expected, rtol=1e-5, atol=1e-6)
            else:
                assert shift.abs().max() == 0


@pytest.mark.parametrize("case", NOISY["cases"], ids=lambda c: f"noise{c['noise_level']}")
def test_noisy_transition_loss_equals_the_authors(case):
    """``transition_noise`` η is their ``noise_level``: ``rgopd_loss`` between the Euler next states with the
    student's std ``max(η·|dt|, 1e-6)`` (1 at η = 0), the loss and its gradient in v_θ at rtol 1e-6."""
    f64 = lambda k: torch.tensor(NOISY[k], dtype=torch.float64).reshape(NOISY["shape"])
    dt = case["next_sigma"] - case["sigma"]
    std = transition_std(case["noise_level"], dt)
    assert std == pytest.approx(case["transition_std"][0], rel=1e-12)
    v = f64("v_theta").requires_grad_(True)
    loss = rg_opd_loss(v, f64("v_star"), dt, std=std)
    loss.backward()
    assert loss.item() == pytest.approx(case["loss"], rel=1e-6)
    torch.testing.assert_close(v.grad.flatten(), torch.tensor(case["grad_v_theta"], dtype=torch.float64),
                               rtol=1e-6, atol=1e-12)


def test_the_trainer_divides_its_transition_loss_by_the_noisy_steps_variance(tmp_path, prompt_file):
    reward_dir = LinearLatentReward.write(tmp_path / "linear", [1.0, -2.0, 0.5, 0.0])
    cfg = small_config(tmp_path / "run", tmp_path, prompt_file, "trainer.name=rg_opd")
    losses = {}
    for noise in (0.0, 0.7):
        tcfg = validate_section(RGOPDConfig, {"name": "rg_opd", "latent_reward": str(reward_dir), "num_steps": 4,
                                              "prompts_per_step": 1, "group_size": 4, "batch_size": 4,
                                              "transition_noise": noise}, "trainer.")
        trainer = RGOPDTrainer(cfg, tcfg, BiasedGaussianPolicy(dim=4), [], read_prompt_file(prompt_file), None,
                               Accelerator(cpu=True), tmp_path / "run")
        batch = trainer.sample(*trainer.step_prompts(0))
        chunk = batch.chunks[0]
        losses[noise] = trainer.loss_at(chunk, 1, chunk.velocities[:, 1] + 0.5).item()
    dt = (chunk.sigmas[2] - chunk.sigmas[1]).item()
    assert losses[0.7] == pytest.approx(losses[0.0] / (0.7 * dt) ** 2, rel=1e-6)


def test_the_target_follows_the_named_heads_combined(tmp_path, prompt_file):
    """``heads`` / ``head_weights``: each visited state's target shift is −κ·rms(v_b)·ĉ/rms(ĉ) with
    ĉ = Σ_h w_h·a_h/rms(a_h), the heads' constant gradients combined as the authors' ``combine``; unknown heads
    and weights of unlisted heads are refused."""
    a, b = [1.0, -2.0, 0.5, 0.0], [0.0, 1.0, 1.0, 3.0]
    reward_dir = LinearHeadsLatentReward.write(tmp_path / "heads", {"a": a, "b": b})
    cfg = small_config(tmp_path / "run", tmp_path, prompt_file, "trainer.name=rg_opd")

    def trainer(**options):
        tcfg = validate_section(RGOPDConfig, {"name": "rg_opd", "latent_reward": str(reward_dir), "num_steps": 4,
                                              "prompts_per_step": 1, "group_size": 4, "batch_size": 4, **options},
                                "trainer.")
        return RGOPDTrainer(cfg, tcfg, BiasedGaussianPolicy(dim=4), [], read_prompt_file(prompt_file), None,
                            Accelerator(cpu=True), tmp_path / "run")

    t = trainer(heads=["a", "b"], head_weights={"b": 0.5})
    batch = t.sample(*t.step_prompts(0))
    unit = t.plan(batch, torch.Generator().manual_seed(0)).steps[0][0]
    chunk = batch.chunks[unit.chunk]
    v_base = chunk.velocities[:, unit.k]  # the toy's reference is its rollout velocity (bias 0 throughout)
    unit_a, unit_b = (torch.tensor(d) / torch.tensor(d).pow(2).mean().sqrt() for d in (a, b))
    combined = unit_a + 0.5 * unit_b
    expected = -0.4 * v_base.pow(2).mean(1).sqrt()[:, None] * combined / combined.pow(2).mean().sqrt()
    torch.testing.assert_close(unit.target - v_base, expected, rtol=1e-5, atol=1e-6)
    with pytest.raises(UserError, match="trainer.heads"):
        trainer(heads=["a", "c"])
    with pytest.raises(UserError, match="trainer.head_weights"):
        trainer(heads=["a"], head_weights={"b": 1.0})


def _rg_opd(tmp_path, model, prompts, reward_dir, *extra):
    return small_config(tmp_path / "run", model, prompts, "trainer.name=rg_opd", f"trainer.latent_reward={reward_dir}",
                        "trainer.num_steps=3", *extra)


@pytest.mark.parametrize("family", ["sd3", "wan"])
def test_zero_kappa_gives_zero_gradient_at_theta_old(family, tmp_path, tiny_model_dir, prompt_file, lrr_dir):
    from rewards.latent_registers import LatentRegisters, load_frozen_transformer

    model = tiny_model_dir(family)
    if family != "sd3":  # the same trainer on video: registers on the Wan transformer
        lrr_dir = tmp_path / "reward"
        LatentRegisters(load_frozen_transformer(str(model), model), num_registers=4, head_hidden=16,
                        base_model=str(model)).save(lrr_dir)
    trainer = build_trainer(_rg_opd(tmp_path, model, prompt_file, lrr_dir, "trainer.kappa=0"))
    prompts, metadata, groups = trainer.step_prompts(0)
    batch = trainer.sample(prompts, metadata, groups)
    chunk = batch.chunks[0]
    for kappa, expect_zero in ((0.0, True), (0.05, False)):
        for k in range(chunk.num_steps):
            x = chunk.latents[:, k]
            grad, _ = reward_gradient(trainer.latent_reward, x, chunk.sigmas[k].item(), chunk.cond)
            target = distillation_target(chunk.velocities[:, k], grad, kappa)
            trainer.loss_at(chunk, k, target).backward()
        norms = [p.grad.abs().max().item() for p in trainer.params if p.grad is not None]
        trainer.optimizer.zero_grad(set_to_none=True)
        assert norms and (max(norms) == 0.0) == expect_zero, (kappa, max(norms))


def test_target_moves_velocity_by_kappa_norm_against_the_gradient():
    v_old, grad = torch.randn(3, 4, 2, 2), torch.randn(3, 4, 2, 2)
    target = distillation_target(v_old, grad, 0.1)
    shift = (target - v_old).flatten(1)
    torch.testing.assert_close(shift.norm(dim=1), 0.1 * v_old.flatten(1).norm(dim=1), rtol=1e-5, atol=0)
    torch.testing.assert_close(torch.nn.functional.cosine_similarity(shift, -grad.flatten(1)), torch.ones(3))


def test_linear_reward_on_a_toy_flow_distils_the_shift(tmp_path, prompt_file):
    """v_θ − v_old → −κ‖v_old‖·â: with one velocity offset b, the optimum is b = −κ·mean‖v_old‖·â."""
    direction = [1.0, -2.0, 0.5, 0.0]
    reward_dir = LinearLatentReward.write(tmp_path / "linear", direction)
    cfg = small_config(tmp_path / "run", tmp_path, prompt_file, "trainer.name=rg_opd")
    # the velocity-space form: θ_old's velocity as the base, every step guided and distilled in one optimiser step
    tcfg = validate_section(RGOPDConfig, {"name": "rg_opd", "latent_reward": str(reward_dir), "kappa": 0.05,
                                          "target_base": "rollout", "active_sigma_min": 0.0, "loss_space": "velocity",
                                          "updates": "per_batch", "optimized_steps": 6, "inner_steps": 400, "lr": 3e-3, "grad_clip": 1e3, "weight_decay": 0.0,
                                          "num_steps": 6, "prompts_per_step": 2, "group_size": 4, "batch_size": 4},
                            "trainer.")
    policy = BiasedGaussianPolicy(dim=4)
    trainer = RGOPDTrainer(cfg, tcfg, policy, [], read_prompt_file(prompt_file), None, Accelerator(cpu=True), tmp_path / "run")
    prompts, metadata, groups = trainer.step_prompts(0)
    batch = trainer.sample(prompts, metadata, groups)
    v_old = torch.cat([c.velocities for c in batch.chunks])  # (N, T, D) at θ_old (b = 0)
    batch.advantages = torch.zeros(len(prompts))
    trainer.update(batch, torch.Generator().manual_seed(0))
    a_hat = torch.tensor(direction) / torch.tensor(direction).norm()
    expected = -0.05 * v_old.norm(dim=-1).mean() * a_hat
    torch.testing.assert_close(policy.trainable.bias.detach(), expected, rtol=2e-2, atol=1e-4)


def test_core_run_refits_registers_checkpoints_them_and_resumes_bit_identically(tmp_path, tiny_sd3_dir, prompt_file, lrr_dir):
    """The refit reward and the buffer of generated pairs (two steps' worth) are both restored on resume:
    the second refit of a resumed run reads the first step's pairs from the checkpoint."""
    core = ("trainer.core={every: 1, steps: 2, batch_size: 4, buffer_steps: 2}", "trainer.kappa=0.1", "run.checkpoint_every=1")
    start = load_file(str(lrr_dir / "registers.safetensors"))

    straight = build_trainer(_rg_opd(tmp_path / "a", tiny_sd3_dir, prompt_file, lrr_dir, *core, "trainer.max_steps=2"))
    straight.train()
    ck = tmp_path / "a" / "run" / "checkpoints" / "step-000002"
    saved = load_file(str(ck / "trainable.safetensors"))  # the trainer's state rides with the weights
    assert not torch.equal(saved["behaviour.latent_reward.registers"], start["registers"])  # CoRe did refit them
    torch.testing.assert_close(saved["behaviour.latent_reward.registers"], straight.latent_reward.registers.detach(),
                               atol=0, rtol=0)
    assert (tmp_path / "a" / "run" / "latent_reward" / "config.json").exists()
    logged = [json.loads(line) for line in (tmp_path / "a" / "run" / "metrics.jsonl").read_text().splitlines()]
    assert "latent/score" in logged[0] and "train/core_bt_real" in logged[0]
    buffered = [s for s, _ in straight.core_buffer]
    assert buffered == [0, 1] and logged[1]["train/core_generated_pairs"] > logged[0]["train/core_generated_pairs"]

    first = build_trainer(_rg_opd(tmp_path / "b", tiny_sd3_dir, prompt_file, lrr_dir, *core, "trainer.max_steps=1"))
    first.train()
    resumed = build_trainer(_rg_opd(tmp_path / "b", tiny_sd3_dir, prompt_file, lrr_dir, *core, "trainer.max_steps=2"))
    resumed.train()
    assert resumed.step == 2
    assert [s for s, _ in resumed.core_buffer] == buffered
    for (_, a), (_, b) in zip(resumed.core_buffer, straight.core_buffer):
        assert a.prompts == b.prompts and torch.equal(a.chosen, b.chosen) and torch.equal(a.rejected, b.rejected)
    for name, p in straight.trainable_state().items():
        torch.testing.assert_close(resumed.trainable_state()[name], p, atol=0, rtol=0)
    torch.testing.assert_close(resumed.latent_reward.registers, straight.latent_reward.registers, atol=0, rtol=0)


def test_bad_config(tmp_path, tiny_sd3_dir, prompt_file, lrr_dir):
    with pytest.raises(UserError, match="latent_reward"):
        build_trainer(_rg_opd(tmp_path, tiny_sd3_dir, prompt_file, tmp_path / "nowhere"))
    # full fine-tuning's anchor runs a frozen copy of the starting weights (no adapter to switch off)
    full = build_trainer(_rg_opd(tmp_path / "f", tiny_sd3_dir, prompt_file, lrr_dir, "model.finetune=full",
                                 "trainer.anchor_weight=1e-4"))
    assert full.policy.reference_modules is not None
    # the former name is refused with the new one (Flow-OPD's name for its anchor term's weight)
    with pytest.raises(UserError, match="trainer.anchor_weight"):
        build_trainer(_rg_opd(tmp_path / "a", tiny_sd3_dir, prompt_file, lrr_dir, "trainer.anchor=1e-4"))
    with pytest.raises(UserError, match="trainer.core.anchor_weight"):
        build_trainer(_rg_opd(tmp_path / "c", tiny_sd3_dir, prompt_file, lrr_dir, "trainer.core={anchor: 1.0}"))
