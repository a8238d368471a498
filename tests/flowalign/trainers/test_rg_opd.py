"""RG-OPD and CoRe: the properties of ``docs/methods/latent_registers.md`` on a toy flow and on the tiny SD3 model."""

import json

import pytest
import torch
from accelerate import Accelerator
from safetensors.torch import load_file

from flowalign.config import validate_section
from flowalign.data import read_prompt_file
from flowalign.errors import UserError
from flowalign.trainers.parts.latent_preference import PreferencePairs
from flowalign.sampling import reward_gradient
from flowalign.train import build_trainer
from flowalign.trainers.rg_opd import RGOPDConfig, RGOPDTrainer, distillation_target

from .conftest import small_config
from .toy_latent import BiasedGaussianPolicy, LinearLatentReward


@pytest.fixture(scope="module")
def lrr_dir(tiny_sd3_dir, tmp_path_factory):
    """Random latent registers on the tiny SD3 model, with a small real-pairs file for CoRe."""
    import pipelines
    from rewards.latent_registers import LatentRegisters, load_frozen_transformer

    folder = tmp_path_factory.mktemp("lrr") / "reward"
    reward = LatentRegisters(load_frozen_transformer(str(tiny_sd3_dir), tiny_sd3_dir), num_registers=4,
                             head_hidden=16, base_model=str(tiny_sd3_dir))
    reward.save(folder)
    shape = pipelines.load(tiny_sd3_dir).latent_shape
    gen = torch.Generator().manual_seed(0)
    pairs = PreferencePairs(["a red circle", "a blue square"] * 4, torch.randn(8, *shape, generator=gen),
                            torch.randn(8, *shape, generator=gen))
    pairs.save(folder / "pairs.safetensors")
    return folder


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
    tcfg = validate_section(RGOPDConfig, {"name": "rg_opd", "latent_reward": str(reward_dir), "kappa": 0.05,
                                          "inner_steps": 400, "lr": 3e-3, "grad_clip": 1e3, "weight_decay": 0.0,
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
