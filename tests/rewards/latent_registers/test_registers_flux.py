"""Latent Reward Registers on a tiny random FLUX transformer (one double- and one single-stream block):
the spec's properties, and the cheap path against the definition (registers appended to the image tokens
with the identity rotation, masked so no image or text query sees them, run through the real blocks)."""

import copy

import pytest
import torch
from diffusers import FluxPipeline

import pipelines
from flowalign.errors import UserError
from flowalign.sampling import load_latent_reward
from rewards.latent_registers import LatentRegisters, load_frozen_transformer


@pytest.fixture(scope="module")
def policy(tiny_flux_dir):
    return pipelines.load(tiny_flux_dir)


@pytest.fixture
def reward(policy, tiny_flux_dir):
    tr = load_frozen_transformer(str(tiny_flux_dir), tiny_flux_dir)
    return LatentRegisters(tr, num_registers=3, layers=[0, 1], head_hidden=16, base_model=str(tiny_flux_dir), seed=2,
                           family_options={"latent_hw": list(policy.latent_hw), "guidance": 3.5})


def _inputs(policy, b=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(b, *policy.latent_shape, generator=gen)
    cond = policy.encode(["a red circle", "a blue square", "two green stars"][:b])
    return x, torch.tensor([0.9, 0.5, 0.2][:b]), cond


def test_velocity_with_registers_is_bit_identical_to_the_policy_velocity(policy, reward):
    x, sigma, cond = _inputs(policy)
    assert reward.transformer.config.num_layers >= 1 and reward.transformer.config.num_single_layers >= 1
    with torch.no_grad():
        v_reg, score = reward.forward_with_velocity(x, sigma, cond)
        v_plain = policy.velocity(x, sigma, cond, guidance=3.5)
    torch.testing.assert_close(v_reg, v_plain, atol=0, rtol=0)
    assert score.shape == (3,) and torch.isfinite(score).all()


def test_gradient_reaches_x_and_registers_but_no_dit_parameter(policy, reward):
    x, sigma, cond = _inputs(policy)
    x.requires_grad_(True)
    reward.score(x, sigma, cond).sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
    assert reward.registers.grad.abs().sum() > 0
    assert all(p.grad is None for p in reward.transformer.parameters())


def test_invariant_to_permuting_registers(policy, reward):
    x, sigma, cond = _inputs(policy)
    with torch.no_grad():
        before = reward.score(x, sigma, cond)
        reward.registers.copy_(reward.registers[torch.tensor([1, 2, 0])])
        permuted = reward.score(x, sigma, cond)
    torch.testing.assert_close(permuted, before, atol=1e-5, rtol=1e-5)


def test_cheap_path_equals_registers_appended_to_the_image_tokens(policy, reward):
    x, sigma, cond = _inputs(policy)
    tr = copy.deepcopy(reward.transformer)
    b, n_img = x.shape[:2]
    m = reward.registers.shape[0]
    h_lat, w_lat = policy.latent_hw
    with torch.no_grad():
        embeds = cond.tensors["prompt_embeds"]
        n_txt = embeds.shape[1]
        ids = torch.cat([torch.zeros(n_txt, 3), FluxPipeline._prepare_latent_image_ids(b, h_lat // 2, w_lat // 2, "cpu", torch.float32)])
        cos, sin = tr.pos_embed(ids)
        rotary = (torch.cat([cos, torch.ones_like(cos[:m])]), torch.cat([sin, torch.zeros_like(sin[:m])]))
        is_reg = torch.arange(n_txt + n_img + m) >= n_txt + n_img  # sequence [text; image; registers]
        mask = {"attention_mask": ~is_reg[None, :] | is_reg[:, None]}
        temb = tr.time_text_embed(sigma * 1000, torch.full((b,), 3500.0), cond.tensors["pooled_prompt_embeds"])
        c = tr.context_embedder(embeds)
        h = torch.cat([tr.x_embedder(x), reward.registers.unsqueeze(0).expand(b, -1, -1)], 1)
        feats = []
        for i, blk in enumerate(list(tr.transformer_blocks) + list(tr.single_transformer_blocks)):
            c, h = blk(hidden_states=h, encoder_hidden_states=c, temb=temb, image_rotary_emb=rotary,
                       joint_attention_kwargs=mask)
            if i in reward.layers:
                feats.append(h[:, n_img:].mean(1))
        expected = reward.head(torch.cat(feats, -1)).squeeze(-1)
        score = reward.score(x, sigma, cond)
    torch.testing.assert_close(score, expected, atol=1e-5, rtol=1e-4)


def test_save_load_round_trip_keeps_the_family_options(policy, reward, tmp_path):
    x, sigma, cond = _inputs(policy)
    with torch.no_grad():
        reward.registers.add_(0.1)
        expected = reward.score(x, sigma, cond)
    reward.save(tmp_path / "r")
    loaded = load_latent_reward(tmp_path / "r")
    assert loaded.family.latent_hw == tuple(policy.latent_hw) and loaded.family.guidance == 3.5
    with torch.no_grad():
        torch.testing.assert_close(loaded.score(x, sigma, cond), expected, atol=0, rtol=0)


def test_bad_input(policy, reward):
    x, sigma, cond = _inputs(policy)
    with pytest.raises(UserError, match="latent_hw"):
        reward.score(x[:, :-1], sigma, cond)
    with pytest.raises(UserError, match="packed latents"):
        reward.score(x.unsqueeze(1), sigma, cond)
