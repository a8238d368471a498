"""``unified_reward`` against its authors' code (known answers in ``known_answers/unified_reward_reference.json``).

``mode: score``: yifan123/flow_grpo @ ac4c86e, ``flow_grpo/rewards.py`` ``unifiedreward_score_sglang``, was called on
two fixed batches (72×96 and 640×576) with its ``AsyncOpenAI`` client replaced by one that records each
``chat.completions.create`` call and answers a fixed reply per caption. Kept: the SHA-256 and length of each question
text sent, the size and the SHA-256 of the decoded 8-bit pixels of each image sent (their PNG of the image resized
to 512² by PIL's default filter), the message layout and sampling fields, and the rewards (``x / 5``, 0 for a reply
without a score), plus the reward of ten more replies on their own.

``mode: think_pairwise``: CodeGoat24/Pref-GRPO @ 3e787f6, ``fastvideo/rewards/unifiedreward_think.py``
``cal_win_rate_images`` with their ``vllm_utils/vllm_request.py`` client, the template of ``templates.py``
formatted with the caption as ``dispatcher.py`` does, and the images written as their rollout writes them
(diffusers' ``VaeImageProcessor.postprocess``, PNG); only ``requests.Session.post`` was replaced, by one that records
the payload and answers a fixed reply per pair. Kept: the text's SHA-256, each image's size and decoded pixels (their
JPEG at quality 95 of the full-size image), the payload's fields, the pairs in order and the win rates; the outcome
of ten more replies judged on their own (``_pairwise_win_rate``); what a failed request and a lone sample give.
``think_c541ed1``: the same at Pref-GRPO c541ed1, whose template is UnifiedReward-Think-qwen-7b's.

Mapped: flowalign is driven through its ``url:`` client against a loopback server (``tests/fake_http.py``) that
recognises each image by the SHA-256 of its decoded pixels among theirs and answers the reply they were given for
it, so a different prompt, resize, codec, pair order or parse shows up as a different hash or reward. Deliberate
differences, pinned here: a score reply without ``Final Score: x`` is invalid (theirs: 0); a failed pairwise
request is left out (their loop raises ``KeyError`` after ten attempts); a sample alone with its prompt is invalid
(theirs: 0); flowalign asks for greedy decoding with ``temperature: 0`` (Pref-GRPO sends ``do_sample: false``, no
field of the chat-completions API) and at most ``max_tokens`` 512 in score mode (Flow-GRPO sends none).
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import rewards
from flowalign.errors import UserError
from rewards.unified_reward import (
    SCORE_QUESTION,
    THINK_QUESTION,
    THINK_QUESTION_QWEN3VL,
    parse_final_score,
    parse_verdict,
)
from tests.fake_http import FakeServer, head
from tests.rewards.known_images import known_batch

KNOWN = json.loads((Path(__file__).parent / "known_answers" / "unified_reward_reference.json").read_text())
FG, PG = KNOWN["flow_grpo"], KNOWN["pref_grpo"]


def sha256(data: bytes | str) -> str:
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()


def decoded(url: str) -> np.ndarray:
    """The 8-bit RGB pixels of a data URL, as a server decodes them."""
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))).convert("RGB"))


def parts(body: dict) -> tuple[list[np.ndarray], str, list[str]]:
    (message,) = body["messages"]
    content = message["content"]
    images = [decoded(p["image_url"]["url"]) for p in content if p["type"] == "image_url"]
    return images, content[-1]["text"], [p["type"] for p in content]


def judge(reply_of):
    """A chat-completions server answering ``reply_of(request body)`` (None: HTTP 500)."""

    def handler(srv, conn, request):
        text = reply_of(json.loads(request))
        if text is None:
            raw = json.dumps({"error": {"message": "down"}}).encode()
            srv.send(conn, head(500, length=len(raw)) + raw)
            return
        raw = json.dumps({"choices": [{"message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
                          "usage": {"prompt_tokens": 1}}).encode()
        srv.send(conn, head(200, length=len(raw)) + raw)

    return FakeServer(handler)


def load(srv: FakeServer, **options):
    return rewards.load("unified_reward", url=srv.url, model="UnifiedReward", retries=0, timeout=30, concurrency=2,
                        **options)


# ---------------------------------------------------------------- score mode: Flow-GRPO's unifiedreward_score_sglang


def test_the_questions_are_their_texts_byte_for_byte():
    assert (sha256(SCORE_QUESTION.format(prompt="")), len(SCORE_QUESTION.format(prompt=""))) == \
        (FG["question_empty_caption"]["sha256"], FG["question_empty_caption"]["chars"])
    for label, text in (("3e787f6", THINK_QUESTION_QWEN3VL), ("c541ed1", THINK_QUESTION)):
        known = PG["template_empty_caption"][label]
        assert (sha256(text.format(prompt="")), len(text.format(prompt=""))) == (known["sha256"], known["chars"])


@pytest.mark.parametrize("name", ["score", "score_large"])
def test_score_mode_sends_their_question_and_512_image_and_scores_x_over_5(name):
    case = FG["batches"][name]
    x, prompts = known_batch(case["batch"])
    reply = dict(zip(prompts, case["replies"]))
    with judge(lambda body: reply[parts(body)[1].rsplit("Text Caption: [", 1)[1][:-1]]) as srv:
        out = load(srv)(x, prompts, [])
        bodies = list(srv.bodies)
    theirs = {r["caption"]: r for r in case["requests"]}
    assert len(bodies) == len(prompts)
    for body in bodies:
        (image,), text, layout = parts(body)
        sent = theirs[text.rsplit("Text Caption: [", 1)[1][:-1]]
        assert (sha256(text), len(text)) == (sent["text_sha256"], sent["text_chars"])
        assert list(image.shape[:2]) == sent["image_hw"] == [512, 512]
        assert sha256(image.tobytes()) == sent["image_pixels_sha256"]
        assert layout == case["request"]["layout"] == ["image_url", "text"]
        assert [m["role"] for m in body["messages"]] == case["request"]["roles"]
        assert body["temperature"] == case["request"]["temperature"] == 0
        assert body["max_tokens"] == 512 and case["request"]["other_keys"] == []  # theirs sets no reply cap
    ours = out.components["unified_reward"]
    for i, (r, theirs_r) in enumerate(zip(case["replies"], case["rewards"])):
        if parse_final_score(r) is None:  # deliberate: no score is an invalid sample, theirs scores it 0
            assert theirs_r == 0.0 and not out.valid[i] and "Final Score" in out.info[i]["reason"]
        else:
            assert out.valid[i] and ours[i].item() == torch.tensor(theirs_r, dtype=torch.float32).item()


def test_score_replies_read_as_theirs():
    for text, theirs in FG["reply_table"]:
        x = parse_final_score(text)
        if x is None:
            assert theirs == 0.0, text
        else:
            assert x / 5.0 == theirs, text


# ---------------------------------------------------------------- think_pairwise: Pref-GRPO's cal_win_rate_images


def jpeg_q95_pixels_sha256(case: dict) -> list[str]:
    """The hashes of the batch's 8-bit images after a JPEG round trip at quality 95 through the installed Pillow:
    what their client sends. They equal the recorded ``image_pixels_sha256`` under the Pillow the answers were
    recorded with (``test_their_jpeg_pixels_are_pillows_quality_95``); another Pillow's JPEG codec may round
    differently, so the server also knows the images by these."""
    x, _ = known_batch(case["batch"])
    out = []
    for image in (x * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy():
        buffer = io.BytesIO()
        Image.fromarray(image).save(buffer, format="JPEG", quality=95)
        out.append(sha256(np.asarray(Image.open(buffer).convert("RGB")).tobytes()))
    return out


def test_their_jpeg_pixels_are_pillows_quality_95():
    import PIL

    recorded = KNOWN["provenance"]["libraries"]["pillow"]
    if PIL.__version__ != recorded:
        pytest.skip(f"the JPEG pixels were recorded with Pillow {recorded}; this is {PIL.__version__}")
    for name in ("think", "think_c541ed1"):
        assert jpeg_q95_pixels_sha256(PG[name]) == PG[name]["image_pixels_sha256"]


def pairwise_server(case: dict, fail=()):
    """Answers each pair with the reply they were given for it, the images recognised by their pixels' hashes
    (recorded, or the installed Pillow's JPEG of the same images); records the pairs (by their indices) and any
    image whose pixels are not theirs (index -1)."""
    index = {h: i for i, h in enumerate(case["image_pixels_sha256"])}
    if "batch" in case:
        index |= {h: i for i, h in enumerate(jpeg_q95_pixels_sha256(case))}
    reply = {(a, b): text for a, b, text in case.get("replies", [])}
    seen: list[tuple[int, int]] = []

    def reply_of(body):
        images, _, _ = parts(body)
        pair = tuple(index.get(sha256(im.tobytes()), -1) for im in images)
        seen.append(pair)
        return None if pair in fail else reply.get(pair, "<answer>Image 1 is better</answer>")

    return judge(reply_of), seen


def test_think_pairwise_sends_pref_grpos_request_and_gives_their_win_rates():
    case = PG["think"]
    x, prompts = known_batch(case["batch"])
    server, seen = pairwise_server(case)
    with server as srv:
        out = load(srv, mode="think_pairwise")(x, prompts, [])
        bodies = list(srv.bodies)
    assert sorted(seen) == [tuple(p) for p in case["pairs_sent"]]  # each pair once, the earlier sample first
    request = case["request"]
    for body in bodies:
        images, text, layout = parts(body)
        assert (sha256(text), len(text)) == (request["text_sha256"], request["text_chars"])
        assert layout == request["layout"] == ["image_url", "image_url", "text"]
        assert [list(im.shape[:2]) for im in images] == [case["image_hw"][0]] * 2 == [[80, 64]] * 2  # not resized
        assert body["max_tokens"] == request["payload"]["max_tokens"] == 4096
        assert body["temperature"] == 0 and request["payload"]["do_sample"] is False
    assert out.valid.all()
    assert out.components["unified_reward"].tolist() == case["rewards"]  # rounded to 3 decimals, in float32


def test_think_prompt_qwen2_5vl_sends_pref_grpos_former_template():
    case = PG["think_c541ed1"]
    x, prompts = known_batch(case["batch"])
    server, seen = pairwise_server(case)
    with server as srv:
        out = load(srv, mode="think_pairwise", think_prompt="qwen2_5vl")(x, prompts, [])
        texts = {parts(b)[1] for b in srv.bodies}
    assert [(sha256(t), len(t)) for t in texts] == [(case["request"]["text_sha256"], case["request"]["text_chars"])]
    assert -1 not in {i for p in seen for i in p}
    assert out.components["unified_reward"].tolist() == case["rewards"]
    assert case["request"]["payload"] == {"model": "UnifiedReward", "max_tokens": 2048}  # theirs then; ours 4096


@pytest.mark.parametrize("former,changes", [
    ({"verdict_parse": "lenient"}, "rewards"),
    ({"win_rate_decimals": None}, "rewards"),
    ({"think_prompt": "qwen2_5vl"}, "text"),
    ({"image_size": 512}, "pixels"),
    ({"jpeg_quality": None}, "pixels"),
    ({"max_tokens": 512}, "cap"),
])
def test_each_former_form_departs_from_theirs(former, changes):
    """The former forms stay selectable, and each gives another request or other rewards than Pref-GRPO's."""
    case = PG["think"]
    x, prompts = known_batch(case["batch"])
    server, seen = pairwise_server(case)
    with server as srv:
        out = load(srv, mode="think_pairwise", **former)(x, prompts, [])
        texts = {parts(b)[1] for b in srv.bodies}
        caps = {b["max_tokens"] for b in srv.bodies}
    if changes == "pixels":
        assert all(p == (-1, -1) for p in seen)
    elif changes == "cap":
        assert caps == {512} != {case["request"]["payload"]["max_tokens"]}
    elif changes == "text":
        assert [sha256(t) for t in texts] != [case["request"]["text_sha256"]]
    else:
        diff = (out.components["unified_reward"] - torch.tensor(case["rewards"])).abs().max().item()
        assert diff > (0.1 if "verdict_parse" in former else 1e-4)


def test_verdicts_read_as_pref_grpos_reader():
    for text, theirs in PG["reply_table"]:
        v = parse_verdict(text)
        assert {1: [1.0, 0.0], 2: [0.0, 1.0], None: [0.5, 0.5]}[v] == theirs, text


def test_a_failed_request_is_left_out_where_their_loop_stops():
    """Deliberate: their win-rate loop reads ``first_index`` from the failure record, which has none, and raises
    after ten attempts; flowalign leaves the comparison out (here the only one, so both samples are invalid)."""
    case = PG["failed_request"]
    assert case["attempts"] == 10 and case["raises"] == "KeyError: 'first_index'"
    x, prompts = known_batch(case["batch"])
    server, _ = pairwise_server({"image_pixels_sha256": []}, fail={(-1, -1)})
    with server as srv:
        out = load(srv, mode="think_pairwise")(x, prompts, [])
    assert out.valid.tolist() == [False, False] and out.info[0]["comparisons"] == 0


def test_a_lone_sample_is_invalid_where_theirs_scores_0():
    case = PG["single_sample"]
    assert case["requests"] == 0 and case["rewards"] == [0.0]
    x, prompts = known_batch(case["batch"])
    server, seen = pairwise_server({"image_pixels_sha256": []})
    with server as srv:
        out = load(srv, mode="think_pairwise")(x, prompts, [])
    assert seen == [] and out.valid.tolist() == [False] and "at least 2 samples" in out.info[0]["reason"]


def test_bad_new_option_values_are_one_line():
    with pytest.raises(UserError, match="think_prompt='qwen3' is not known; use one of qwen3vl"):
        rewards.load("unified_reward", url="http://127.0.0.1:9/v1", mode="think_pairwise", think_prompt="qwen3")
    with pytest.raises(UserError, match="verdict_parse='strict' is not known; use one of answer"):
        rewards.load("unified_reward", url="http://127.0.0.1:9/v1", verdict_parse="strict")
    for option, value in (("jpeg_quality", 0), ("win_rate_decimals", -1), ("max_tokens", "all"), ("image_size", 8)):
        with pytest.raises(UserError, match=f"{option}="):
            rewards.load("unified_reward", url="http://127.0.0.1:9/v1", **{option: value})
