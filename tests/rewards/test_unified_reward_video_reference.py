"""``unified_reward`` on videos against Pref-GRPO's Wan judges (known answers in
``known_answers/unified_reward_video_reference.json``, provenance inside).

CodeGoat24/Pref-GRPO @ 3e787f6 judges a group of videos with ``cal_win_rate_videos`` (UnifiedReward-Think and
UnifiedReward-Flex): 8 evenly spaced frames of each video, JPEG 95, the first video's then the second's in one
request with the video template. Their functions were run on three lossless videos against a fake server; here the
same videos go through the reward's ``url:`` client to a loopback judge answering their replies, and the frames,
the text and the rewards must be theirs.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from flowalign.errors import UserError
from rewards.unified_reward_video import FLEX_VIDEO_QUESTION, THINK_VIDEO_QUESTION, frame_indices
from tests.rewards.test_unified_reward_reference import judge, load, parts

KNOWN = json.loads((Path(__file__).parent / "known_answers" / "unified_reward_video_reference.json").read_text())
QUESTIONS = {"think": THINK_VIDEO_QUESTION, "flex": FLEX_VIDEO_QUESTION}
OPTIONS = {"think": dict(mode="think_pairwise"),
           "flex": dict(mode="flex_pairwise", overall_weight=0.3, dim_weight=0.7, category_weights=[1.0, 0.7, 0.7])}


def videos() -> torch.Tensor:
    """The three videos of the known answers, ``(3, 9, 3, 40, 56)`` in [0, 1] (8-bit values)."""
    out = []
    for v in range(3):
        t, y, x = np.mgrid[0:9, 0:40, 0:56].astype(np.float64)
        frames = np.stack([127.5 + 120 * np.sin(x / (6 + c + v) + y / (9 + 2 * c) + t * (0.4 + 0.1 * v) + c + v)
                           for c in range(3)], 1)
        out.append(np.clip(np.round(frames), 0, 255).astype(np.uint8))
    return torch.from_numpy(np.stack(out)).float() / 255


def sha256(data: bytes | str) -> str:
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()


def test_the_frames_shown_are_their_linspace_choice():
    for count, indices in KNOWN["frame_indices"].items():
        assert frame_indices(int(count), 8) == indices


@pytest.mark.parametrize("judgement", ["think", "flex"])
def test_each_pair_of_videos_is_their_request_and_the_rewards_theirs(judgement):
    known = KNOWN[judgement]
    question = QUESTIONS[judgement]
    assert (sha256(question), len(question)) == (known["template_sha256"], known["template_chars"])
    frame_hashes = {}
    for request in known["requests"]:
        a, b = request["pair"]
        frame_hashes[a] = request["frame_pixels_sha256"][:8]
        frame_hashes[b] = request["frame_pixels_sha256"][8:]
    which = {tuple(h): i for i, h in frame_hashes.items()}
    replies = {tuple(pair): text for pair, text in known["replies"]}
    seen = []

    def reply_of(body):
        images, text, layout = parts(body)
        assert layout == ["image_url"] * 16 + ["text"]
        hashes = [sha256(im.tobytes()) for im in images]
        pair = (which.get(tuple(hashes[:8]), -1), which.get(tuple(hashes[8:]), -1))
        seen.append((pair, sha256(text)))
        return replies.get(pair, "<answer>Video 1 is better</answer>")

    with judge(reply_of) as srv:
        out = load(srv, **OPTIONS[judgement])(videos(), [KNOWN["prompt"]] * 3, [])
    assert sorted(seen) == sorted((tuple(r["pair"]), r["problem_sha256"]) for r in known["requests"])
    assert out.valid.all()
    assert out.components["unified_reward"].tolist() == pytest.approx(known["rewards"], abs=1e-6)


def test_a_video_reply_names_videos_and_score_mode_refuses_videos():
    from rewards.unified_reward import parse_verdict

    assert parse_verdict("<answer>Video 2 is better</answer>", noun="Video") == 2
    assert parse_verdict("<answer>Image 2 is better</answer>", noun="Video") is None  # their exact phrase
    assert parse_verdict("<answer>video 1 IS better</answer>", "lenient", noun="Video") == 1
    with judge(lambda body: "Final Score: 5") as srv:
        with pytest.raises(UserError, match="mode: score judges images; videos are judged in pairs"):
            load(srv)(videos(), ["a"] * 3, [])
        with pytest.raises(UserError, match="frames=0 must be an integer from 1 to 256"):
            load(srv, mode="think_pairwise", frames=0)
