"""The ``aesthetic`` reward: LAION MLP head on a tiny random open_clip model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import rewards
from flowalign.errors import UserError
from rewards.aesthetic import AestheticHead, AestheticScore

LAION_KEYS = {f"layers.{i}.{p}" for i in (0, 2, 4, 6, 7) for p in ("weight", "bias")}


@pytest.fixture(scope="module")
def head_file(tmp_path_factory) -> Path:
    """A random head for the tiny model's 32-d embeddings, saved as LAION's .pth is (a plain state dict)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        head = AestheticHead(32)
    path = tmp_path_factory.mktemp("aesthetic") / "head.pth"
    torch.save(head.state_dict(), path)
    return path


@pytest.fixture(scope="module")
def reward(tiny_clip_spec, head_file) -> AestheticScore:
    return rewards.load("aesthetic", head_path=str(head_file), model=tiny_clip_spec)


def test_layout_matches_laion_checkpoint():
    assert set(AestheticHead().state_dict()) == LAION_KEYS
    assert AestheticHead().layers[0].in_features == 768  # OpenAI CLIP ViT-L/14 embeddings


def test_equals_head_on_normalised_clip_embedding(reward, head_file, images):
    x = images(3)
    out = reward(x, ["", "", ""], [])
    assert reward.name == "aesthetic" and reward.differentiable is True
    assert out.components["aesthetic"].shape == (3,) and out.valid.all()
    head = AestheticHead(32).eval()
    head.load_state_dict(torch.load(head_file, weights_only=True))
    with torch.no_grad():
        expected = head(reward.clip.encode_images(x))
    assert torch.allclose(reward.clip.encode_images(x).norm(dim=-1), torch.ones(3))
    torch.testing.assert_close(out.components["aesthetic"], expected, atol=1e-6, rtol=0)


def test_safetensors_head_round_trips(tmp_path, tiny_clip_spec, reward, head_file, images):
    from safetensors.torch import save_file

    save_file(torch.load(head_file, weights_only=True), tmp_path / "head.safetensors")
    other = AestheticScore(head_path=str(tmp_path / "head.safetensors"), model=tiny_clip_spec)
    x = images(2, seed=1)
    assert torch.equal(other(x, ["", ""], []).components["aesthetic"], reward(x, ["", ""], []).components["aesthetic"])


def test_batching_dtype_and_gradient(tiny_clip_spec, head_file, reward, images):
    x = images(8, seed=2)
    small = AestheticScore(head_path=str(head_file), model=tiny_clip_spec, batch_size=2)(x, [""] * 8, [])
    torch.testing.assert_close(small.components["aesthetic"], reward(x, [""] * 8, []).components["aesthetic"],
                               atol=1e-5, rtol=0)
    bf16 = AestheticScore(head_path=str(head_file), model=tiny_clip_spec, dtype="bf16")(x, [""] * 8, [])
    assert bf16.components["aesthetic"].dtype == torch.float32
    torch.testing.assert_close(bf16.components["aesthetic"], small.components["aesthetic"], atol=0.03, rtol=0)
    xg = images(2, size=96).requires_grad_(True)
    reward(xg, ["", ""], []).total.sum().backward()
    assert torch.isfinite(xg.grad).all() and xg.grad.abs().sum() > 0


def test_random_init_needs_no_files(tiny_clip_spec, images):
    torch.manual_seed(0)
    out = AestheticScore(model=tiny_clip_spec, random_init=True)(images(2), ["", ""], [])
    assert torch.isfinite(out.components["aesthetic"]).all()


def test_missing_or_wrong_head(tmp_path, tiny_clip_spec):
    with pytest.raises(UserError, match=r"aesthetic reward: path is not set; download sac\+logos\+ava1-l14-linearMSE.pth"):
        AestheticScore(model=tiny_clip_spec)
    with pytest.raises(UserError, match="path='/no/head.pth' does not exist"):
        AestheticScore(head_path="/no/head.pth", model=tiny_clip_spec)
    torch.save(AestheticHead(768).state_dict(), tmp_path / "vit_l_head.pth")  # a head for another backbone
    with pytest.raises(UserError, match="32-d CLIP embedding"):
        AestheticScore(head_path=str(tmp_path / "vit_l_head.pth"), model=tiny_clip_spec)
