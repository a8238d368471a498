"""``unified_reward`` ``mode: edit_pairwise`` against Pref-GRPO's UnifiedReward-Edit judge (known answers in
``known_answers/unified_reward_edit_reference.json``, provenance inside).

CodeGoat24/Pref-GRPO @ 3e787f6 compares the edits of one source under one instruction two by two with
``cal_win_rate_edit_images``: a request shows the source, then the two edits, then the edit template. Their function
was run on eight edits of two sources under two instructions (three groups) against a recording server; here the
same images go through the reward's ``url:`` client to a loopback judge answering their replies.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from flowalign.errors import UserError
from rewards.unified_reward_edit import EDIT_PAIRWISE_QUESTION, parse_edit_verdict
from tests.rewards.test_unified_reward_reference import judge, load, parts

KNOWN = json.loads((Path(__file__).parent / "known_answers" / "unified_reward_edit_reference.json").read_text())


def image(seed: int, h: int = 24, w: int = 32) -> torch.Tensor:
    """The known answers' image ``seed`` as ``(3, h, w)`` in [0, 1] (8-bit values)."""
    y, x = np.mgrid[0:h, 0:w].astype(np.float64)
    pixels = np.stack([127.5 + 120 * np.sin(x / (3 + c + seed) + y / (5 + c) + seed) for c in range(3)])
    return torch.from_numpy(np.clip(np.round(pixels), 0, 255).astype(np.uint8)).float() / 255


def sha256(data: bytes | str) -> str:
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()


def test_the_template_is_theirs_byte_for_byte():
    assert (sha256(EDIT_PAIRWISE_QUESTION), len(EDIT_PAIRWISE_QUESTION)) == (KNOWN["template_sha256"],
                                                                             KNOWN["template_chars"])


def test_each_pair_of_edits_is_their_request_and_the_win_rates_theirs():
    samples = KNOWN["samples"]
    sources = {"s0": image(0), "s1": image(1)}
    which = {h: (int(k) if k.isdigit() else k) for k, h in KNOWN["pixels_sha256"].items()}
    replies = {tuple(pair): text for pair, text in KNOWN["replies"]}
    seen = []

    def reply_of(body):
        images, text, layout = parts(body)
        assert layout == ["image_url"] * 3 + ["text"]
        ids = [which.get(sha256(im.tobytes()), -1) for im in images]
        seen.append({"images": ids, "problem_sha256": sha256(text)})
        return replies.get((ids[1], ids[2]), "")

    x = torch.stack([image(s["image_seed"]) for s in samples])
    metadata = [{"image": sources[s["source"]]} for s in samples]
    with judge(reply_of) as srv:
        out = load(srv, mode="edit_pairwise")(x, [s["instruction"] for s in samples], metadata)
    key = lambda r: (str(r["images"]), r["problem_sha256"])  # noqa: E731
    assert sorted(seen, key=key) == sorted(KNOWN["requests"], key=key)
    assert out.valid.all()
    assert out.components["unified_reward"].tolist() == pytest.approx(KNOWN["rewards"], abs=1e-6)


def test_their_reading_of_a_reply_and_the_refusals():
    assert parse_edit_verdict("<answer>Edited image 2 is better</answer>") == 2
    assert parse_edit_verdict("<answer>none</answer> but edited image 1 is better") == 1  # then the whole reply
    assert parse_edit_verdict("<answer> </answer> edited image 1 is better") == 0  # an empty answer: a tie
    assert parse_edit_verdict(None) == parse_edit_verdict("") == 0
    with judge(lambda body: "") as srv:
        reward = load(srv, mode="edit_pairwise")
        with pytest.raises(UserError, match="edit_pairwise shows the judge each sample's source image"):
            reward(torch.rand(2, 3, 8, 8), ["a", "a"], [{}, {}])
        with pytest.raises(UserError, match="edit_pairwise judges edited images, not videos"):
            reward(torch.rand(2, 3, 3, 8, 8), ["a", "a"], [{"image": torch.rand(3, 8, 8)}] * 2)
        lone = reward(torch.rand(1, 3, 8, 8), ["a"], [{"image": torch.rand(3, 8, 8)}])
        assert not lone.valid.any()  # their code gives a lone edit 0; here it is not judged


POINTWISE = json.loads((Path(__file__).parent / "known_answers" / "unified_reward_edit_pointwise_reference.json")
                       .read_text())


@pytest.mark.parametrize("mode", ["edit_quality", "edit_instruction"])
def test_pointwise_judgements_are_their_requests_scores_and_parts(mode):
    """Each edit judged alone (quality) or after its source (instruction following): the same images, text and
    two scores as their ``score_edit_*``, blended 0.6 / 0.4 as their flux2 klein pointwise script sets it."""
    from rewards.unified_reward_edit import EDIT_QUALITY_QUESTION, edit_instruction_question

    key = "quality" if mode == "edit_quality" else "instruction"
    samples = POINTWISE["samples"]
    which = {h: (int(k) if k.isdigit() else k) for k, h in POINTWISE["pixels_sha256"].items()}
    replies = POINTWISE[f"{key}_replies"]
    seen = []

    def reply_of(body):
        images, text, _ = parts(body)
        ids = [which.get(sha256(im.tobytes()), -1) for im in images]
        seen.append({"images": ids, "problem_sha256": sha256(text)})
        return replies[ids[-1]]

    x = torch.stack([image(s["image_seed"]) for s in samples])
    metadata = [{"image": image(0 if s["source"] == "s0" else 1)} for s in samples]
    with judge(reply_of) as srv:
        out = load(srv, mode=mode, part_weights=[0.6, 0.4])(x, [s["instruction"] for s in samples], metadata)
    by_edit = lambda r: r["images"][-1]  # noqa: E731
    assert sorted(seen, key=by_edit) == sorted(POINTWISE[f"{key}_requests"], key=by_edit)
    assert sha256(EDIT_QUALITY_QUESTION) == POINTWISE["quality_template_sha256"]
    if mode == "edit_instruction":
        assert {r["problem_sha256"] for r in seen} == {sha256(edit_instruction_question(s["instruction"])) for s in samples}
    assert out.valid.all()
    assert out.components["unified_reward"].tolist() == pytest.approx(POINTWISE[key]["combined"], abs=1e-5)
    first, second = ("naturalness", "artifacts") if key == "quality" else ("success", "overedit")
    assert [i[first] for i in out.info] == POINTWISE[key]["dim0"]
    assert [i[second] for i in out.info] == POINTWISE[key]["dim1"]


def test_pointwise_advantages_blend_each_parts_advantage_as_theirs():
    """Pref-GRPO's advantage of a pointwise edit reward blends its two parts' group advantages (w 0.6 / 0.4), the
    two rewards weighted 0.5 / 0.5, with ``--apply_gdpo`` off and on."""
    from flowalign.reward_set import RewardSet
    from tests.rewards.test_unified_reward_flex_reference import assert_their_advantages

    samples = POINTWISE["samples"]
    x = torch.stack([image(s["image_seed"]) for s in samples])
    prompts = [s["instruction"] for s in samples]
    metadata = [{"image": image(0 if s["source"] == "s0" else 1)} for s in samples]
    which = {h: (int(k) if k.isdigit() else k) for k, h in POINTWISE["pixels_sha256"].items()}

    def answering(replies):
        return judge(lambda body: replies[which[sha256(parts(body)[0][-1].tobytes())]])

    with answering(POINTWISE["quality_replies"]) as q, answering(POINTWISE["instruction_replies"]) as i:
        rewards = [("quality", 0.5, load(q, mode="edit_quality", part_weights=[0.6, 0.4])),
                   ("instruction", 0.5, load(i, mode="edit_instruction", part_weights=[0.6, 0.4]))]
        scores = RewardSet(rewards).score(x, prompts, metadata)
    assert_their_advantages(scores, torch.tensor([0, 0, 0, 1, 1, 1]), POINTWISE["advantages"])


def test_pointwise_replies_are_read_as_theirs_and_what_they_score_0_is_invalid():
    from rewards.unified_reward_edit import parse_edit_scores

    for text, theirs in POINTWISE["odd_replies"]:
        ours = parse_edit_scores(text)
        assert (list(ours) if ours is not None else [0.0, 0.0]) == theirs
        assert ours is not None or theirs == [0.0, 0.0]  # their fallback [0, 0] is an invalid sample here
    with judge(lambda body: "") as srv:
        with pytest.raises(UserError, match="part_weights is read only with mode: edit_quality or edit_instruction"):
            load(srv, mode="think_pairwise", part_weights=[0.6, 0.4])
        with pytest.raises(UserError, match=r"part_weights=\[1\] must be two numbers"):
            load(srv, mode="edit_quality", part_weights=[1])
