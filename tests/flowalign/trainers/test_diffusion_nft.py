"""DiffusionNFT (the baseline of docs/methods/diffusion_opsd.md): its loss and a short real run."""

from __future__ import annotations

import pytest
import torch

from flowalign import checkpoint as ckpt
from flowalign.train import build_trainer
from flowalign.trainers.diffusion_nft import nft_loss
from flowalign.trainers.diffusion_opsd import opsd_loss

from .conftest import small_config


@pytest.mark.parametrize("beta", [1.0, 0.3])
def test_nft_gradient_vanishes_at_theta_equals_phi_and_r_half_while_opsd_does_not(beta):
    g = torch.Generator().manual_seed(0)
    v_phi, target, z_q, a = (torch.randn(3, 16, generator=g) for _ in range(4))
    half = torch.full((3,), 0.5)
    v_theta = v_phi.clone().requires_grad_(True)
    nft_loss(v_theta, v_phi, target, half, beta)[0].sum().backward()
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


def test_nft_loss_moves_v_theta_toward_the_data_velocity_for_good_samples():
    """r = 1: the fit pulls v⁺ (= v_θ at β=1) to v = ε − x; r = 0 pushes v⁻ there, so v_θ moves away."""
    g = torch.Generator().manual_seed(1)
    v_phi, target = torch.randn(2, 8, generator=g), torch.randn(2, 8, generator=g)
    for r_value, closer in ((1.0, True), (0.0, False)):
        v_theta = v_phi.clone().requires_grad_(True)
        nft_loss(v_theta, v_phi, target, torch.full((2,), r_value), 1.0)[0].sum().backward()
        stepped = v_phi - 0.01 * v_theta.grad
        assert (((stepped - target).norm(dim=1) < (v_phi - target).norm(dim=1)) == closer).all()


def test_real_units_at_theta_equals_phi_and_r_half_give_exactly_zero_gradient(tmp_path, tiny_sd3_dir, prompt_file):
    t = build_trainer(small_config(tmp_path / "z", tiny_sd3_dir, prompt_file, "trainer.name=diffusion_nft",
                                   "trainer.timesteps_per_sample=2"))
    prompts, metadata, groups = t.step_prompts(0)
    chunk = t.sample(prompts, metadata, groups).chunks[0]
    with t.behaviour.swapped_in():
        units = t.fit_units(chunk, torch.full((len(chunk),), 0.5), torch.ones(len(chunk), dtype=torch.bool),
                          torch.Generator().manual_seed(0))
    assert len(units) == 2 and units[0].tensors["t"] != units[1].tensors["t"]
    for unit in units:
        loss, _ = t.fit_loss(unit)
        loss.sum().backward()
    assert all(p.grad is None or torch.equal(p.grad, torch.zeros_like(p)) for p in t.params)


def test_short_run_with_a_non_differentiable_reward_checkpoints_phi(tmp_path, tiny_sd3_dir, prompt_file):
    """NFT takes any reward (the redness function has no gradient); φ is saved with the run and
    one update with λ = 0 makes φ equal θ."""
    t = build_trainer(small_config(tmp_path / "r", tiny_sd3_dir, prompt_file, "trainer.name=diffusion_nft",
                                   "trainer.timesteps_per_sample=2", "trainer.behaviour_rate=0",
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
    extra = ["trainer.name=diffusion_nft", "trainer.timesteps_per_sample=1"]
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
