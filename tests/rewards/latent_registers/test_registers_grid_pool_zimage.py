"""What only Z-Image's grid-pool registers have and read: the σ-embedding bridge, each caption cut to its mask,
σ entering as t = 1 - σ, and their manifest's other spelling of the backbone. The properties every family
shares, Z-Image's known answers included, are checked in ``test_registers_grid_pool.py``."""

import pytest
import torch

from flowalign.protocols import Conditioning
from flowalign.sampling import load_latent_reward

from .grid_pool_families import ZIMAGE, assert_equals_known


@pytest.mark.parametrize("entry", ZIMAGE.shape_entries)
def test_the_sigma_embedding_bridge_maps_the_adaln_input_to_the_transformers_width(entry):
    # Z-Image's adaLN input is min(dim, 256) wide; the tiny transformer's dim is 32
    assert list(ZIMAGE.authors_weights(entry).temb_proj.weight.shape) == [32, 32]


def test_caption_lengths_and_sigma_are_read():
    """Each sample's caption is cut to its mask, and σ enters as t = 1 - σ: the full padded caption, or σ read as
    t, scores otherwise, so the known answer does not pass by accident."""
    x, sigma, cond = ZIMAGE.inputs()
    want = torch.tensor(ZIMAGE.answers("paper")["scores"]["preference"])
    reward = ZIMAGE.authors_weights()
    full = Conditioning({**cond.tensors, "prompt_embeds_mask": torch.ones_like(cond.tensors["prompt_embeds_mask"])},
                        cond.prompts)
    assert not torch.allclose(reward.score(x, sigma, full), want, rtol=1e-3)
    assert not torch.allclose(reward.score(x, 1 - sigma, cond), want, rtol=1e-3)
    # the longest caption alone scores as in the batch: the batch padding is masked out of the trunk's and the
    # registers' attention; a shorter one does not, as theirs: its text taps carry the batch's padding rows
    # (zeroed, but the head reads them unmasked)
    def alone(i):
        one = Conditioning({k: v[i: i + 1] for k, v in cond.tensors.items()}, cond.prompts[i: i + 1])
        return reward.score(x[i: i + 1], sigma[i: i + 1], one)

    torch.testing.assert_close(alone(1), want[1:], rtol=1e-5, atol=1e-6)
    assert not torch.allclose(alone(0), want[:1], rtol=1e-3)


def test_authors_manifest_spelling_zimage_reads_as_their_z_image(tmp_path):
    """Their Z-Image manifests name the backbone ``z-image``; one spelled ``zimage`` loads the same model."""
    base = tmp_path / "zimage"
    ZIMAGE.transformer.save_pretrained(str(base / "transformer"))
    folder = ZIMAGE.write_authors_folder(tmp_path / "theirs", manifest_over={"backbone": "zimage"})
    assert_equals_known(load_latent_reward(folder, base_model=str(base)), ZIMAGE)
