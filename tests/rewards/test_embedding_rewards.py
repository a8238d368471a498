"""The rewards that score an image embedding (CLIP score, HPS, PickScore, aesthetic) offer both halves apart,
``features`` and ``feature_scores`` (:class:`flowalign.protocols.FeatureReward`), and they compose to the score."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import rewards
from flowalign.protocols import FeatureReward
from flowalign.reward_set import RewardSet, time_limited

PROMPTS = ["a red circle", "two blue squares", "a red circle", "a green star on white", "three stars"]


@pytest.fixture(scope="module", params=["clip_score", "hps", "pickscore", "aesthetic"])
def reward(request, tiny_clip_spec, tiny_pickscore_dir):
    if request.param == "pickscore":
        return rewards.load("pickscore", path=str(tiny_pickscore_dir), batch_size=2)
    if request.param == "aesthetic":
        torch.manual_seed(0)
        return rewards.load("aesthetic", model=tiny_clip_spec, random_init=True, batch_size=2)
    return rewards.load(request.param, model=tiny_clip_spec, batch_size=2)


def test_the_score_is_feature_scores_of_features(reward, images):
    """Batches of 2 over 5 samples: the halves compose to ``__call__``'s score, the features are unit
    CLIP embeddings, and the gradient reaches the pixels through both halves."""
    assert isinstance(reward, FeatureReward)
    x = images(5, seed=3).requires_grad_(True)
    features = reward.features(x, PROMPTS, [])
    assert features.shape == (5, reward.clip.embed_dim) and features.dtype == torch.float32
    torch.testing.assert_close(features.norm(dim=1), torch.ones(5))
    scores = reward.feature_scores(features, PROMPTS, [])
    torch.testing.assert_close(scores, reward(x, PROMPTS, []).total, rtol=1e-6, atol=1e-6)
    (grad,) = torch.autograd.grad(scores.sum(), x)
    assert grad.abs().sum() > 0


def test_clip_scores_gradient_in_feature_space_is_the_prompts_text_embedding(tiny_clip_spec, images):
    """``R(f) = f·t``: ∇_f R is the prompt's unit text embedding, whatever the image."""
    reward = rewards.load("clip_score", model=tiny_clip_spec)
    f = F.normalize(torch.randn(5, reward.clip.embed_dim), dim=1).requires_grad_(True)
    (grad,) = torch.autograd.grad(reward.feature_scores(f, PROMPTS, []).sum(), f)
    torch.testing.assert_close(grad, reward.clip.encode_texts(PROMPTS, torch.device("cpu"), 8))


def test_a_run_of_one_embedding_reward_offers_it_with_its_weight(tiny_clip_spec):
    clip = time_limited("clip_score", rewards.load("clip_score", model=tiny_clip_spec))
    weight, found = RewardSet([("clip_score", 2.5, clip)]).embedding_reward()
    assert weight == 2.5 and found is clip  # the deadline's wrapper passes the halves through
    jpeg = rewards.load("jpeg_compressibility")
    assert not isinstance(jpeg, FeatureReward)
    assert RewardSet([("jpeg_compressibility", 1.0, jpeg)]).embedding_reward() is None
    assert RewardSet([("clip_score", 1.0, clip), ("jpeg_compressibility", 1.0, jpeg)]).embedding_reward() is None
    assert RewardSet().embedding_reward() is None
