"""DiffusionNFT (the baseline of docs/methods/diffusion_opsd.md): its loss and a short real run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from flowalign import checkpoint as ckpt
from flowalign.train import build_trainer
from flowalign.trainers.diffusion_nft import drawn_timesteps, nft_loss
from flowalign.trainers.self_distill import reward_weight
from flowalign.trainers.diffusion_opsd import opsd_loss

from .conftest import small_config


KNOWN = json.loads((Path(__file__).parent / "known_answers" / "diffusion_nft_loss.json").read_text())


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
