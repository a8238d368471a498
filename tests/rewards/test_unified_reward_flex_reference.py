"""``unified_reward`` ``mode: flex_pairwise`` against Pref-GRPO's UnifiedReward-Flex code (known answers in
``known_answers/unified_reward_flex_reference.json``, provenance inside).

CodeGoat24/Pref-GRPO @ 3e787f6: ``_pairwise_win_rate`` (``fastvideo/rewards/unifiedreward_flex.py``) read twelve
fixed replies for two prompts' groups of four (JSON, fenced JSON, no JSON, ties, a missing ``cat_winner``, a fourth
category, a category named "overall", a reply without categories) under the weights of their Flex recipe, their
defaults and ``DIM_WEIGHT`` 0; ``compute_weighted_advantages`` (``dispatcher.py``) turned them into advantages with
``--apply_gdpo`` off and on. flowalign's reward is driven through its ``url:`` client against a loopback judge that
answers each pair with that reply (the images recognised by their JPEG-95 pixels, as the think_pairwise test does),
and the loop's advantage function reads its scores.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from flowalign.errors import UserError
from flowalign.reward_set import RewardSet
from flowalign.trainers.rollouts import gathered_advantages
from rewards.unified_reward_flex import FLEX_QUESTION, parse_flex
from tests.rewards.known_images import known_batch
from tests.rewards.test_unified_reward_reference import load, pairwise_server

KNOWN = json.loads((Path(__file__).parent / "known_answers" / "unified_reward_flex_reference.json").read_text())
CASE = {"batch": KNOWN["batch"], "replies": KNOWN["replies"], "image_pixels_sha256": []}
#: the settings as unified_reward options
OPTIONS = {"recipe": dict(overall_weight=0.3, dim_weight=0.7, category_weights=[1.0, 0.7, 0.7]),
           "defaults": {}, "no_dims": dict(overall_weight=1.0, dim_weight=0.0)}
ACC = SimpleNamespace(device=torch.device("cpu"), process_index=0, gather=lambda t: t)  # one process


def test_the_template_is_theirs_byte_for_byte():
    text = FLEX_QUESTION.format(prompt="")
    assert (hashlib.sha256(text.encode()).hexdigest(), len(text)) == (KNOWN["template_empty_prompt"]["sha256"],
                                                                     KNOWN["template_empty_prompt"]["chars"])


def score(setting: str, **extra):
    x, prompts = known_batch(KNOWN["batch"])
    server, seen = pairwise_server(CASE)
    with server as srv:
        reward = load(srv, mode="flex_pairwise", **OPTIONS[setting], **extra)
        scores = RewardSet([("unified_reward", 0.7, reward)]).score(x, prompts, [])
        texts = {b["messages"][0]["content"][-1]["text"] for b in srv.bodies}
    assert -1 not in {i for pair in seen for i in pair}  # every image sent is one of theirs, JPEG 95 at full size
    assert sorted(seen) == sorted((a, b) for a, b, _ in KNOWN["replies"])
    assert texts == {FLEX_QUESTION.format(prompt=p) for p in set(prompts)}
    return scores


@pytest.mark.parametrize("setting", list(OPTIONS))
def test_win_rates_rewards_and_advantages_are_their_codes(setting):
    theirs = KNOWN["settings"][setting]
    scores = score(setting)
    assert scores.valid.all()
    assert scores.values[:, 0].tolist() == theirs["rewards"]  # float32, their blend (the last category's weight)
    parts = scores.parts["unified_reward"]
    assert parts[:, 0].tolist() == theirs["overall"] and parts[:, 1].tolist() == theirs["dim_mean"]
    assert parts[:, 2].bool().tolist() == theirs["has_dims"]
    assert_their_advantages(scores, torch.tensor([0] * 4 + [1] * 4), theirs["advantages"])


def assert_their_advantages(scores, groups: torch.Tensor, theirs: dict[str, list[float]]) -> None:
    """The loop's Pref-GRPO advantages of ``scores`` equal their ``compute_weighted_advantages`` with ``--use_group``,
    ``--apply_gdpo`` off (``theirs["use_group"]``) and on (``theirs["apply_gdpo"]``), to 1e-5."""
    for gdpo, key in ((False, "use_group"), (True, "apply_gdpo")):
        adv = gathered_advantages("win_rate", scores, groups, ACC, 5.0, win_rate_normalisation="per_reward",
                                  batch_renormalise=gdpo)
        torch.testing.assert_close(adv.double(), torch.tensor(theirs[key], dtype=torch.float64), rtol=1e-5, atol=1e-5)


def test_as_set_blends_with_the_configured_dimension_weight():
    """``flex_blend: as_set``: with ``dim_weight`` 0 the reward is the overall win rate (their code blends with the
    last category's weight all the same); the advantages under ``--apply_gdpo`` do not change."""
    theirs = KNOWN["settings"]["no_dims"]
    scores = score("no_dims", flex_blend="as_set")
    assert scores.values[:, 0].tolist() == torch.tensor(theirs["overall"]).tolist() != theirs["rewards"]
    adv = gathered_advantages("win_rate", scores, torch.tensor([0] * 4 + [1] * 4), ACC, 5.0,
                              win_rate_normalisation="per_reward", batch_renormalise=True)
    torch.testing.assert_close(adv.double(), torch.tensor(theirs["advantages"]["apply_gdpo"], dtype=torch.float64),
                               rtol=1e-5, atol=1e-5)


def test_replies_read_as_theirs():
    """Their reading, and where flowalign's is safer: a non-list ``categories`` (theirs raises) reads as none."""
    assert parse_flex('{"winner": "Image 2", "categories": [{"name": "A", "cat_winner": "image 1"}]}').winner == 2
    assert parse_flex("```json\n{\"winner\": \"Image 1\"}\n```").winner == 1
    assert parse_flex('{"winner": "Image 1/2"}').winner == 1  # "image 2" is not named: their regex, as theirs
    assert parse_flex('{"winner": "Image 1 and Image 2 tie"}').winner is None
    assert parse_flex("no json").categories is None
    assert parse_flex('{"winner": "Image 1", "categories": {"name": "A"}}').categories == ()
    assert parse_flex('[1, 2]').categories is None


def test_a_failed_request_is_left_out_and_options_of_another_mode_are_refused():
    x, prompts = known_batch(KNOWN["batch"])
    server, _ = pairwise_server(CASE, fail={(0, 1)})
    with server as srv:  # two samples of one prompt, their only comparison failed (theirs raises KeyError on it)
        out = load(srv, mode="flex_pairwise")(x[:2], prompts[:2], [])
    assert out.valid.tolist() == [False, False] and out.info[0]["comparisons"] == 0
    assert "no comparison" in out.info[0]["reason"]
    with pytest.raises(UserError, match="read only with mode: flex_pairwise"):
        load(SimpleNamespace(url="http://127.0.0.1:9"), mode="think_pairwise", dim_weight=0.5)
    with pytest.raises(UserError, match="overall_weight \\+ dim_weight must be positive"):
        load(SimpleNamespace(url="http://127.0.0.1:9"), mode="flex_pairwise", overall_weight=0, dim_weight=0)


def test_a_score_reward_beside_the_judge_is_normalised_as_its_scores():
    """Their Flex recipe mixes the judge (0.7) with CLIP (0.3); ``compute_weighted_advantages`` normalises the
    score reward's raw values in each group (``pointwise_rewards: scores``, the default), and the judge's parts as
    above. The former form, the score's win rates, gives other advantages."""
    from flowalign.protocols import RewardOutput

    mixed = KNOWN["mixed"]
    x, prompts = known_batch(KNOWN["batch"])
    clip = torch.tensor(mixed["clip"])

    def clip_like(samples, prompts, metadata):
        return RewardOutput({"clip": clip.clone()}, valid=torch.ones(len(clip), dtype=torch.bool))

    server, _ = pairwise_server(CASE)
    with server as srv:
        judge = load(srv, mode="flex_pairwise", **OPTIONS["recipe"])
        scores = RewardSet([("unified_reward", 0.7, judge), ("clip", 0.3, clip_like)]).score(x, prompts, [])
    groups = torch.tensor([0] * 4 + [1] * 4)
    for gdpo, key in ((False, "use_group"), (True, "apply_gdpo")):
        adv = gathered_advantages("win_rate", scores, groups, ACC, 5.0, win_rate_normalisation="per_reward",
                                  batch_renormalise=gdpo)
        want = torch.tensor(mixed["advantages"][key], dtype=torch.float64)
        torch.testing.assert_close(adv.double(), want, rtol=1e-5, atol=1e-5)
        former = gathered_advantages("win_rate", scores, groups, ACC, 5.0, win_rate_normalisation="per_reward",
                                     batch_renormalise=gdpo, pointwise_rewards="win_rates")
        assert (former.double() - want).abs().max() > 0.05


def test_the_parts_join_across_batches_and_a_failed_batch_is_nan_rows():
    """Scores of consecutive batches keep each sample's parts in order; a batch whose judge failed (no parts)
    joins as NaN rows, which the advantage fills like an invalid sample's values."""
    from flowalign.reward_set import RewardScores

    scores = score("recipe")
    failed = RewardScores(torch.zeros(2, 1), torch.zeros(2, 1, dtype=torch.bool), scores.weights, scores.names)
    joined = RewardScores.cat([scores, failed])
    parts = joined.parts["unified_reward"]
    assert parts.shape == (10, 5) and parts.dtype == torch.float64
    assert torch.equal(parts[:8], scores.parts["unified_reward"]) and torch.isnan(parts[8:]).all()
