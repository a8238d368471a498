"""Latent Reward Registers on a tiny random Wan transformer: the spec's properties, and the cheap path
against the definition (registers appended to the video tokens with the identity rotation, masked so no
video query sees them, run through the real blocks)."""

import copy

import pytest
import torch
from diffusers.models.transformers.transformer_wan import WanAttnProcessor

import pipelines
from flowalign.errors import UserError
from flowalign.sampling import load_latent_reward
from rewards.latent_registers import LatentRegisters, load_frozen_transformer


@pytest.fixture(scope="module")
def policy(tiny_wan_dir):
    return pipelines.load(tiny_wan_dir)


@pytest.fixture
def reward(tiny_wan_dir):
    tr = load_frozen_transformer(str(tiny_wan_dir), tiny_wan_dir)
    return LatentRegisters(tr, num_registers=3, layers="multi", head_hidden=16, base_model=str(tiny_wan_dir), seed=1)


def _inputs(policy, b=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(b, *policy.latent_shape, generator=gen)
    cond = policy.encode(["a red circle moving up", "a blue square moving left", "a green star"][:b])
    return x, torch.tensor([0.9, 0.5, 0.2][:b]), cond


def test_velocity_with_registers_is_bit_identical_to_the_policy_velocity(policy, reward):
    x, sigma, cond = _inputs(policy)
    assert x.ndim == 5
    with torch.no_grad():
        v_reg, score = reward.forward_with_velocity(x, sigma, cond)
        v_plain = policy.velocity(x, sigma, cond, guidance=1.0)
    torch.testing.assert_close(v_reg, v_plain, atol=0, rtol=0)
    assert score.shape == (3,) and torch.isfinite(score).all()
    assert all(not blk._forward_pre_hooks for blk in reward.transformer.blocks)


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
        reward.registers.copy_(reward.registers[torch.tensor([2, 0, 1])])
        permuted = reward.score(x, sigma, cond)
    torch.testing.assert_close(permuted, before, atol=1e-5, rtol=1e-5)


class _MaskedSelfAttention(WanAttnProcessor):
    """Wan's processor over [video; registers] where only register queries see register keys."""

    def __init__(self, n_vid: int):
        super().__init__()
        self.n_vid = n_vid

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        if encoder_hidden_states is None:
            is_reg = torch.arange(hidden_states.shape[1]) >= self.n_vid
            attention_mask = ~is_reg[None, :] | is_reg[:, None]  # (queries, keys)
        return super().__call__(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb)


def test_cheap_path_equals_registers_appended_to_the_video_tokens(policy, reward):
    x, sigma, cond = _inputs(policy)
    tr = copy.deepcopy(reward.transformer)
    m = reward.registers.shape[0]
    with torch.no_grad():
        cos, sin = tr.rope(x)
        n_vid = cos.shape[1]
        for blk in tr.blocks:
            blk.attn1.set_processor(_MaskedSelfAttention(n_vid))
        identity = (torch.cat([cos, torch.ones_like(cos[:, :m])], 1), torch.cat([sin, torch.zeros_like(sin[:, :m])], 1))
        h = tr.patch_embedding(x).flatten(2).transpose(1, 2)
        h = torch.cat([h, reward.registers.unsqueeze(0).expand(x.shape[0], -1, -1)], 1)
        _, temb, context, _ = tr.condition_embedder(sigma * 1000.0, cond.tensors["prompt_embeds"], None)
        temb = temb.unflatten(1, (6, -1))
        feats = []
        for i, blk in enumerate(tr.blocks):
            h = blk(h, context, temb, identity)
            if i in reward.layers:
                feats.append(h[:, n_vid:].mean(1))
        expected = reward.head(torch.cat(feats, -1)).squeeze(-1)
        score = reward.score(x, sigma, cond)
    torch.testing.assert_close(score, expected, atol=1e-5, rtol=1e-4)


def test_save_load_round_trip_by_family(policy, reward, tmp_path):
    x, sigma, cond = _inputs(policy)
    with torch.no_grad():
        reward.registers.add_(0.1)
        expected = reward.score(x, sigma, cond)
    reward.save(tmp_path / "r")
    loaded = load_latent_reward(tmp_path / "r")
    assert type(loaded.transformer).__name__ == "WanTransformer3DModel"
    with torch.no_grad():
        torch.testing.assert_close(loaded.score(x, sigma, cond), expected, atol=0, rtol=0)


def test_bad_input(policy, reward, tiny_sd3_dir, tmp_path):
    x, sigma, cond = _inputs(policy)
    with pytest.raises(UserError, match="video latents"):
        reward.score(x[:, :, 0], sigma, cond)
    from flowalign.protocols import Conditioning

    with pytest.raises(UserError, match="prompt_embeds"):
        reward.score(x, sigma, Conditioning({"other": torch.zeros(3, 2)}))
    reward.save(tmp_path / "r")
    sd3 = load_frozen_transformer(str(tiny_sd3_dir), tiny_sd3_dir)
    with pytest.raises(UserError, match="'wan'"):
        LatentRegisters.load(tmp_path / "r", transformer=sd3)
