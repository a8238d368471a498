"""``unified_reward`` ``mode: dimension`` against Pref-GRPO's pointwise UnifiedReward rewards
(``unifiedreward_alignment`` / ``_style`` / ``_coherence``; known answers in
``known_answers/unified_reward_dimension_reference.json``, provenance inside): the question each image is asked, and
each dimension's score as their ``extract_normalized_rewards`` reads it, on six fixed replies. A sample whose reply
lacks the dimension is invalid here; theirs takes the batch's mean of that dimension."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from flowalign.errors import UserError
from rewards.unified_reward import DIMENSION_QUESTION
from tests.rewards.test_unified_reward_reference import judge, load, parts

KNOWN = json.loads((Path(__file__).parent / "known_answers" / "unified_reward_dimension_reference.json").read_text())


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


@pytest.mark.parametrize("dimension", ["alignment", "style", "coherence"])
def test_each_dimension_is_their_reading_of_the_reply(dimension):
    assert (sha256(DIMENSION_QUESTION), len(DIMENSION_QUESTION)) == (KNOWN["template_sha256"], KNOWN["template_chars"])
    prompts = KNOWN["prompts"]
    reply = {sha256(DIMENSION_QUESTION.format(prompt=p)): r for p, r in zip(prompts, KNOWN["replies"])}
    asked = []

    def reply_of(body):
        images, text, layout = parts(body)
        asked.append(sha256(text))
        assert layout == ["image_url", "text"]
        return reply[sha256(text)]

    with judge(reply_of) as srv:
        out = load(srv, mode="dimension", dimension=dimension)(torch.rand(6, 3, 16, 16), prompts, [])
    assert sorted(asked) == sorted(KNOWN["question_sha256"])
    theirs = KNOWN[dimension]
    got = out.components["unified_reward"].tolist()
    name = dimension.capitalize()
    for i, text in enumerate(KNOWN["replies"]):
        if f"{name} Score" in text:  # the reply names it: their score
            assert out.valid[i] and got[i] == theirs[i]
        else:  # theirs: the batch's mean of the dimension; here an invalid sample
            assert not out.valid[i] and "no 'Coherence Score (1-5): x'" in out.info[i]["reason"]


def test_two_dimensions_ask_the_judge_once_per_image_as_theirs():
    """Pref-GRPO asks once per image and reads every dimension of the reply; two labelled entries do the same:
    the second reads the first's replies (a failed one is asked again), and the next batch is asked anew."""
    prompts = KNOWN["prompts"][:4]
    reply = {sha256(DIMENSION_QUESTION.format(prompt=p)): r for p, r in zip(prompts, KNOWN["replies"])}
    asked = []

    def reply_of(body):
        text = parts(body)[1]
        asked.append(prompts.index(next(p for p in prompts if DIMENSION_QUESTION.format(prompt=p) == text)))
        if asked[-1] == 3 and asked.count(3) == 1:
            return None  # the first request of the last image fails (HTTP 500)
        return reply[sha256(text)]

    images = torch.rand(4, 3, 16, 16)
    with judge(reply_of) as srv:
        alignment = load(srv, mode="dimension", dimension="alignment")
        style = load(srv, mode="dimension", dimension="style")
        a, s = alignment(images, prompts, []), style(images, prompts, [])
        assert sorted(asked) == [0, 1, 2, 3, 3]  # the failed request asked again, the others once
        assert not a.valid[3] and s.valid[3]
        for i in range(3):
            assert a.components["unified_reward"][i] == KNOWN["alignment"][i]
            assert s.components["unified_reward"][i] == KNOWN["style"][i]
        style(torch.rand(4, 3, 16, 16), prompts, [])
        assert len(asked) == 9  # new images: asked again


def test_the_dimension_is_required_with_the_mode_only():
    with judge(lambda body: "") as srv:
        with pytest.raises(UserError, match="mode: dimension reads one dimension of the reply: give dimension"):
            load(srv, mode="dimension")
        with pytest.raises(UserError, match="give dimension"):
            load(srv, mode="score", dimension="style")
        with pytest.raises(UserError, match="dimension='beauty' is not known"):
            load(srv, mode="dimension", dimension="beauty")
