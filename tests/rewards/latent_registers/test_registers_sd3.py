"""Latent registers on SD3 (a tiny random transformer with an SD3.5 dual-attention block): the cheap path
equals the method page's definition (registers appended to the token sequence, masked so no image/text query
sees them), and bad input. The shared properties are in ``test_registers_properties.py``."""

import copy

import pytest
import torch
import torch.nn.functional as F

from flowalign.errors import UserError
from flowalign.sampling import load_latent_reward
from rewards.latent_registers import LatentRegisters, resolve_layers

from .conftest import family_inputs


FAMILY = "sd3"


class _MaskedJointAttention:
    """SD3's joint attention over [image; registers; text] where only register queries see register keys."""

    def __init__(self, n_img: int, n_reg: int):
        self.n_img, self.n_reg = n_img, n_reg

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, **kw):
        b, s, _ = hidden_states.shape

        def heads(t):
            return t.view(b, -1, attn.heads, t.shape[-1] // attn.heads).transpose(1, 2)

        q, k, v = heads(attn.to_q(hidden_states)), heads(attn.to_k(hidden_states)), heads(attn.to_v(hidden_states))
        q, k = attn.norm_q(q), attn.norm_k(k)
        if encoder_hidden_states is not None:
            e = encoder_hidden_states
            cq, ck, cv = heads(attn.add_q_proj(e)), heads(attn.add_k_proj(e)), heads(attn.add_v_proj(e))
            q, k, v = torch.cat([q, attn.norm_added_q(cq)], 2), torch.cat([k, attn.norm_added_k(ck)], 2), torch.cat([v, cv], 2)
        is_reg = torch.zeros(k.shape[2], dtype=torch.bool)
        is_reg[self.n_img : self.n_img + self.n_reg] = True
        allowed = ~is_reg[None, :] | is_reg[:, None]  # (queries, keys)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        out = out.transpose(1, 2).reshape(b, -1, attn.heads * q.shape[-1])
        h, c = out[:, :s], out[:, s:]
        h = attn.to_out[1](attn.to_out[0](h))
        if encoder_hidden_states is None:
            return h
        return h, (c if attn.context_pre_only else attn.to_add_out(c))


def test_cheap_path_equals_registers_appended_to_the_sequence(policy, reward):
    """The method page's definition: registers are extra image-stream tokens, masked out of every other query."""
    x, sigma, cond = family_inputs(policy)
    tr = copy.deepcopy(reward.transformer)
    n_img = (x.shape[-1] // tr.config.patch_size) * (x.shape[-2] // tr.config.patch_size)
    m = reward.registers.shape[0]
    for blk in tr.transformer_blocks:
        blk.attn.set_processor(_MaskedJointAttention(n_img, m))
        if blk.use_dual_attention:
            blk.attn2.set_processor(_MaskedJointAttention(n_img, m))
    with torch.no_grad():
        h = tr.pos_embed(x)
        temb = tr.time_text_embed(sigma * 1000.0, cond.tensors["pooled_prompt_embeds"])
        c = tr.context_embedder(cond.tensors["prompt_embeds"])
        h = torch.cat([h, reward.registers.unsqueeze(0).expand(x.shape[0], -1, -1)], dim=1)
        feats = []
        for i, blk in enumerate(tr.transformer_blocks):
            c, h = blk(hidden_states=h, encoder_hidden_states=c, temb=temb)
            if i in reward.layers:
                feats.append(h[:, n_img:].mean(1))
        expected_score = reward.head(torch.cat(feats, -1)).squeeze(-1)
        out = tr.proj_out(tr.norm_out(h[:, :n_img], temb))
        p, side = tr.config.patch_size, x.shape[-1] // tr.config.patch_size
        out = out.reshape(x.shape[0], side, side, p, p, -1)
        velocity = torch.einsum("nhwpqc->nchpwq", out).reshape(x.shape)
        v_cheap, score = reward.forward_with_velocity(x, sigma, cond)
    torch.testing.assert_close(score, expected_score, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(v_cheap, velocity, atol=1e-5, rtol=1e-4)  # the generator never saw them


def test_bad_input(policy, reward, tmp_path):
    with pytest.raises(UserError, match="latent registers support SD3Transformer2DModel"):
        LatentRegisters(torch.nn.Linear(2, 2))
    with pytest.raises(UserError, match="layers"):
        resolve_layers([5], 2)
    assert resolve_layers("multi", 24) == [11, 17, 23] and resolve_layers([-1], 4) == [3]
    with pytest.raises(UserError, match="latent reward folder"):
        load_latent_reward(tmp_path)
    x, sigma, cond = family_inputs(policy)
    from flowalign.protocols import Conditioning

    with pytest.raises(UserError, match="prompt_embeds"):
        reward.score(x, sigma, Conditioning({"other": torch.zeros(3, 2)}))
