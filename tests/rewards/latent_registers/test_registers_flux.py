"""Latent registers on FLUX (a tiny random transformer, one double- and one single-stream block): the cheap
path equals the definition (registers appended to the image tokens with the identity rotation, masked so
no image or text query sees them, run through the real blocks), the family options persist, bad input.
The shared properties are in ``test_registers_properties.py``."""

import copy

import pytest
import torch
from diffusers import FluxPipeline

from flowalign.errors import UserError
from flowalign.sampling import load_latent_reward

from .conftest import family_inputs


FAMILY = "flux"


def test_cheap_path_equals_registers_appended_to_the_image_tokens(policy, reward):
    x, sigma, cond = family_inputs(policy)
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


def test_family_options_survive_save_and_load(reward, tmp_path):
    reward.save(tmp_path / "r")
    loaded = load_latent_reward(tmp_path / "r")
    assert loaded.family.latent_hw == reward.family.latent_hw and loaded.family.guidance == 3.5


def test_bad_input(policy, reward):
    x, sigma, cond = family_inputs(policy)
    with pytest.raises(UserError, match="latent_hw"):
        reward.score(x[:, :-1], sigma, cond)
    with pytest.raises(UserError, match="packed latents"):
        reward.score(x.unsqueeze(1), sigma, cond)
