"""The ``clip_score`` reward on a tiny random open_clip model loaded from disk."""

from __future__ import annotations

import json

import pytest
import torch

import rewards
from flowalign.errors import UserError
from flowalign.protocols import Reward
from rewards.clip_score import CLIPScore

PROMPTS = ["a red circle", "two blue squares", "a red circle", "a green star on white"]


@pytest.fixture(scope="module")
def reward(tiny_clip_spec: str) -> CLIPScore:
    return rewards.load("clip_score", model=tiny_clip_spec)


def test_registered_protocol_shapes_and_range(reward, images):
    assert isinstance(reward, CLIPScore) and isinstance(reward, Reward)
    assert reward.name == "clip_score" and reward.differentiable is True
    out = reward(images(4), PROMPTS, [])
    score = out.components["clip_score"]
    assert set(out.components) == {"clip_score"} and score.shape == (4,) and score.dtype == torch.float32
    assert out.valid.dtype == torch.bool and out.valid.all()
    assert ((score >= -1) & (score <= 1)).all()


def test_equals_cosine_of_the_in_memory_models_encoders(tiny_open_clip, tiny_clip_spec, reward, images):
    """By hand with the model as built before saving (so loading round-trips); 64 px needs no resize."""
    import open_clip

    model, tokenizer = tiny_open_clip, open_clip.get_tokenizer(tiny_clip_spec)
    x = images(4)
    mean = torch.tensor(open_clip.OPENAI_DATASET_MEAN)[:, None, None]
    std = torch.tensor(open_clip.OPENAI_DATASET_STD)[:, None, None]
    with torch.no_grad():
        img = model.encode_image((x - mean) / std, normalize=True)
        txt = model.encode_text(tokenizer(PROMPTS), normalize=True)
    expected = (img * txt).sum(-1)
    torch.testing.assert_close(reward(x, PROMPTS, []).components["clip_score"], expected, atol=1e-5, rtol=0)


def test_file_checkpoint_of_a_named_architecture_round_trips(tmp_path, tiny_open_clip_dir, tiny_open_clip_cfg,
                                                             reward, images):
    """``model=<name>, pretrained=<file>``: the architecture registered with open_clip, weights from a file."""
    import open_clip

    (tmp_path / "tiny-clip-test.json").write_text(json.dumps(tiny_open_clip_cfg))
    open_clip.add_model_config(tmp_path / "tiny-clip-test.json")
    weights = tiny_open_clip_dir / "open_clip_model.safetensors"
    from_file = rewards.load("clip_score", model="tiny-clip-test", pretrained=str(weights))
    x = images(3, size=96, seed=1)  # larger than 64 px: exercises the resize + crop path too
    torch.testing.assert_close(from_file(x, PROMPTS[:3], []).components["clip_score"],
                               reward(x, PROMPTS[:3], []).components["clip_score"], atol=1e-6, rtol=0)
    random = rewards.load("clip_score", model="tiny-clip-test", random_init=True)
    assert not torch.allclose(random(x, PROMPTS[:3], []).components["clip_score"],
                              reward(x, PROMPTS[:3], []).components["clip_score"])


def test_batching_invariance_and_determinism(tiny_clip_spec, reward, images):
    x = images(8, seed=2)
    prompts = PROMPTS * 2
    small = rewards.load("clip_score", model=tiny_clip_spec, batch_size=2)(x, prompts, [])
    big = rewards.load("clip_score", model=tiny_clip_spec, batch_size=8)(x, prompts, [])
    torch.testing.assert_close(small.components["clip_score"], big.components["clip_score"], atol=1e-5, rtol=0)
    assert torch.equal(reward(x, prompts, []).components["clip_score"], reward(x, prompts, []).components["clip_score"])


def test_bf16_compute_on_cpu(tiny_clip_spec, reward, images):
    x = images(4, seed=4)
    bf16 = rewards.load("clip_score", model=tiny_clip_spec, dtype="bf16", device="cpu")
    assert next(bf16.clip.model.parameters()).dtype == torch.bfloat16
    score = bf16(x, PROMPTS, []).components["clip_score"]
    assert score.dtype == torch.float32
    torch.testing.assert_close(score, reward(x, PROMPTS, []).components["clip_score"], atol=0.03, rtol=0)


def test_gradient_reaches_the_samples(reward, images):
    x = images(2, size=80).requires_grad_(True)  # 80 px: the gradient passes the antialiased resize
    reward(x, PROMPTS[:2], []).total.sum().backward()
    assert torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0
    assert not any(p.requires_grad for p in reward.clip.model.parameters())  # the scorer stays frozen


def test_non_finite_sample_is_invalid_and_isolated(reward, images):
    x = images(3, seed=5)
    clean = reward(x, PROMPTS[:3], []).components["clip_score"]
    x[1, 0, 3, 3] = float("nan")
    out = reward(x, PROMPTS[:3], [])
    assert out.valid.tolist() == [True, False, True] and torch.isfinite(out.components["clip_score"]).all()
    torch.testing.assert_close(out.components["clip_score"][[0, 2]], clean[[0, 2]], atol=1e-6, rtol=0)


def test_bad_options_and_inputs(tmp_path, reward, images):
    with pytest.raises(UserError, match="pretrained='/no/such/ViT.pt': no such file"):
        CLIPScore(model="ViT-B-32", pretrained="/no/such/ViT.pt")
    with pytest.raises(UserError, match="not an open_clip architecture"):
        CLIPScore(model="ViT-Tiny-Nope", random_init=True)
    with pytest.raises(UserError, match="no open_clip_config.json"):
        CLIPScore(model=f"local-dir:{tmp_path}")
    with pytest.raises(UserError, match="pretrained is not set"):
        CLIPScore(model="ViT-B-32", pretrained=None)
    with pytest.raises(UserError, match="batch_size"):
        CLIPScore(random_init=True, batch_size=0)
    with pytest.raises(UserError, match="3 samples but 2 prompts"):
        reward(images(3), PROMPTS[:2], [])
    with pytest.raises(UserError, match="clip_score_video"):
        reward(images(2).unsqueeze(1), PROMPTS[:2], [])
