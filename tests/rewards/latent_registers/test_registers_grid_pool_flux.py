"""What only FLUX's grid-pool registers read: the embedded guidance and the packed token grid (``latent_hw``), given
to the reward or taken from the authors' folder. The properties every family shares, FLUX's known answers
included, are checked in ``test_registers_grid_pool.py``."""

import torch

from flowalign.sampling import load_latent_reward

from .grid_pool_families import FLUX, FLUX_LATENT_HW


def test_guidance_and_the_token_grid_are_read():
    """The guidance value reaches the embedding, and the pooled grid is the packed one (a transposed grid of the
    same token count pools other tokens), so neither known answer passes by accident."""
    x, sigma, cond = FLUX.inputs()
    want = torch.tensor(FLUX.answers("paper")["scores"]["preference"])
    reward = FLUX.authors_weights()
    reward.inputs.guidance = 5.0
    assert not torch.allclose(reward.score(x, sigma, cond), want, rtol=1e-3)
    reward = FLUX.authors_weights()
    reward.inputs.latent_hw = (8, 32)
    assert not torch.allclose(reward.score(x, sigma, cond), want, rtol=1e-3)


def test_authors_folder_gives_the_token_grid_and_their_guidance(tmp_path):
    """Their ``vis_h`` × ``vis_w`` packed grid is ``latent_hw`` / 2, and their backbone's embedded guidance, 3.5,
    is the one the reward embeds."""
    folder = FLUX.write_authors_folder(tmp_path / "theirs")
    base = tmp_path / "flux"
    FLUX.transformer.save_pretrained(str(base / "transformer"))
    reward = load_latent_reward(folder, base_model=str(base))
    assert reward.inputs.latent_hw == tuple(FLUX_LATENT_HW) and reward.inputs.guidance == 3.5
