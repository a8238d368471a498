"""Latent registers on Wan (a tiny random transformer): the cheap path equals the definition (registers
appended to the video tokens with the identity rotation, masked so no video query sees them, run through
the real blocks), and bad input. The shared properties are in ``test_registers_properties.py``."""

import copy

import pytest
import torch
from diffusers.models.transformers.transformer_wan import WanAttnProcessor

from flowalign.errors import UserError
from rewards.latent_registers import LatentRegisters, load_frozen_transformer

from .conftest import family_inputs


FAMILY = "wan"


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
    x, sigma, cond = family_inputs(policy)
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


def test_bad_input(policy, reward, tiny_sd3_dir, tmp_path):
    x, sigma, cond = family_inputs(policy)
    with pytest.raises(UserError, match="video latents"):
        reward.score(x[:, :, 0], sigma, cond)
    from flowalign.protocols import Conditioning

    with pytest.raises(UserError, match="prompt_embeds"):
        reward.score(x, sigma, Conditioning({"other": torch.zeros(3, 2)}))
    reward.save(tmp_path / "r")
    sd3 = load_frozen_transformer(str(tiny_sd3_dir), tiny_sd3_dir)
    with pytest.raises(UserError, match="'wan'"):
        LatentRegisters.load(tmp_path / "r", transformer=sd3)
