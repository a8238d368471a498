"""The Thinking Reward Model's released protocol (``vlm_judge`` modes ``trm`` and ``trm_edit``) against the
authors' code: ``known_answers/trm_checklist_parse.json`` holds what bxhsort/Thinking_Reward_Model @ eb53345
computes (its reply reader on fixed replies, its prompts' hashes, its user texts for a fixed prompt)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from flowalign.errors import UserError
from rewards import vlm_trm_prompts
from rewards.judge_server import BadRequest, to_chat_request
from rewards.vlm_backend import ChatRequest, Completion, LocalVLM
from rewards.vlm_http import OpenAIChatClient
from rewards.vlm_judge import LocalVLMJudge, VLMJudge
from rewards.vlm_parse import parse_checklist
from tests.fake_http import FakeServer, answer
from tests.rewards.test_vlm_judge import Recorded, smooth_images

KNOWN = json.loads((Path(__file__).parent / "known_answers" / "trm_checklist_parse.json").read_text())
REPLIES = KNOWN["replies"]
PROMPTS = KNOWN["prompts"]


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


@pytest.mark.parametrize("case", sorted(REPLIES))
def test_the_reply_reader_scores_as_the_authors_reader(case: str):
    theirs, ours = REPLIES[case], parse_checklist(REPLIES[case]["text"])
    if case == "nan_score":
        # the one deliberate difference: their clamp max(0, min(10, nan)) makes NaN a perfect 10
        assert theirs["final_score"] == 10.0 and not ours.ok and "not finite" in ours.reason
    elif "error" in theirs:
        assert not ours.ok and ours.reason, f"theirs raises {theirs['error']}; ours must leave the sample unscored"
    else:
        assert ours.ok and ours.score == pytest.approx(theirs["final_score"], abs=0)
        assert ours.score / 10 == pytest.approx(theirs["reward"], rel=1e-12)


def test_the_prompts_are_the_released_texts_word_for_word():
    assert (sha256(vlm_trm_prompts.T2I_SYSTEM), len(vlm_trm_prompts.T2I_SYSTEM)) == \
        (PROMPTS["t2i_system_sha256"], PROMPTS["t2i_system_chars"])
    assert (sha256(vlm_trm_prompts.EDIT_SYSTEM), len(vlm_trm_prompts.EDIT_SYSTEM)) == \
        (PROMPTS["edit_system_sha256"], PROMPTS["edit_system_chars"])
    assert vlm_trm_prompts.T2I_USER.format(instruction=PROMPTS["prompt"]) == PROMPTS["t2i_user"]
    assert vlm_trm_prompts.EDIT_USER.format(instruction=PROMPTS["instruction"]) == PROMPTS["edit_user"]


def test_trm_mode_sends_the_released_request_and_scores_final_score_over_ten():
    replies = [REPLIES["plain"]["text"], REPLIES["fenced"]["text"], REPLIES["not_json"]["text"],
               Completion(text=None, error="timeout")]
    j = VLMJudge(Recorded(replies), mode="trm")
    x = smooth_images(4)
    out = j(x, [PROMPTS["prompt"]] * 4, [])
    (calls,) = j.backend.calls
    assert len(calls) == 4  # one call per sample, no rubric call before
    r: ChatRequest = calls[0]
    assert r.messages[0] == {"role": "system", "content": vlm_trm_prompts.T2I_SYSTEM}
    image, text = r.messages[1]["content"]
    assert r.messages[1]["role"] == "user" and image["type"] == "image" and text["text"] == PROMPTS["t2i_user"]
    assert np.array_equal(np.asarray(image["image"]), (x[0].permute(1, 2, 0) * 255).round().byte().numpy())
    assert (r.max_tokens, r.temperature, r.template_kwargs, r.assistant_prefix) == \
        (PROMPTS["t2i_max_new_tokens"], PROMPTS["temperature"], {"enable_thinking": PROMPTS["enable_thinking"]}, "")
    s = out.components["vlm_judge"]
    assert out.valid.tolist() == [True, True, False, False]
    assert s[:2].tolist() == pytest.approx([REPLIES["plain"]["reward"], REPLIES["fenced"]["reward"]])
    assert out.info[0]["final_score"] == 8.3 and out.info[0]["score_reason"] == "ok"
    assert "no JSON object" in out.info[2]["reason"] and "timeout" in out.info[3]["reason"]


def test_trm_edit_shows_the_source_image_before_the_edit():
    source, edited = smooth_images(1, seed=5)[0], smooth_images(2, seed=6)
    j = VLMJudge(Recorded([REPLIES["preamble"]["text"], REPLIES["above_scale"]["text"]]), mode="trm_edit")
    out = j(edited, [PROMPTS["instruction"]] * 2, [{"image": source}, {"image": source}])
    r = j.backend.calls[0][0]
    assert r.messages[0]["content"] == vlm_trm_prompts.EDIT_SYSTEM and r.max_tokens == PROMPTS["edit_max_new_tokens"]
    first, second, text = r.messages[1]["content"]
    as_bytes = lambda t: (t.permute(1, 2, 0) * 255).round().byte().numpy()  # noqa: E731
    assert np.array_equal(np.asarray(first["image"]), as_bytes(source))
    assert np.array_equal(np.asarray(second["image"]), as_bytes(edited[0]))
    assert text["text"] == PROMPTS["edit_user"]
    assert out.components["vlm_judge"].tolist() == pytest.approx([0.25, 1.0])


def test_the_trm_modes_refuse_what_their_checkpoints_cannot_read():
    with pytest.raises(UserError, match="drop question"):
        VLMJudge(Recorded([]), mode="trm", question="Rate {prompt}")
    with pytest.raises(UserError, match="judges images"):
        VLMJudge(Recorded([]), mode="trm")(torch.rand(1, 2, 3, 16, 16), ["a clip"], [])
    with pytest.raises(UserError, match=r"metadata\[1\] has no 'image'"):
        VLMJudge(Recorded([]), mode="trm_edit")(smooth_images(2), ["edit"] * 2, [{"image": torch.rand(3, 8, 8)}, {}])
    with pytest.raises(UserError, match="enable_thinking"):
        VLMJudge(Recorded([]), mode="trm", enable_thinking="no")


def test_trm_mode_on_the_tiny_vlm_renders_the_system_prompt(vlm_dir: Path):
    """The real model path: the system prompt reaches the chat template; the random judge's gibberish is no
    JSON verdict, so each sample is unscored with its reason (none scored 0)."""
    j = LocalVLMJudge(str(vlm_dir), mode="trm", max_tokens=6)
    out = j(smooth_images(2), ["a red circle"] * 2, [])
    assert not out.valid.any() and all("not a score" in x["reason"] for x in out.info)
    request = j._request([], "Rate it.", "", system=vlm_trm_prompts.T2I_SYSTEM)
    assert "checklist-style evaluation points" in j.backend.render(request)


def test_the_thinking_switch_reaches_the_chat_template(vlm_dir: Path):
    vlm = LocalVLM(vlm_dir)
    # a Qwen3-style template reads enable_thinking; this one writes down what it was given
    vlm.processor.chat_template = ("{% for m in messages %}{{ m['role'] }}{% endfor %}"
                                   "{% if enable_thinking is defined %}[thinking={{ enable_thinking }}]{% endif %}")
    plain = ChatRequest([{"role": "user", "content": "hi"}])
    off = ChatRequest([{"role": "user", "content": "hi"}], template_kwargs={"enable_thinking": False})
    assert "[thinking" not in vlm.render(plain) and "[thinking=False]" in vlm.render(off)


def test_the_thinking_switch_travels_over_http():
    with FakeServer(answer({"choices": [{"message": {"content": '{"final_score": 6}'}}]})) as srv:
        client = OpenAIChatClient(srv.url, model="trm-t2i-reward", timeout=5, retries=0)
        j = VLMJudge(client, mode="trm")
        assert j(smooth_images(1), ["a red circle"], []).components["vlm_judge"].tolist() == pytest.approx([0.6])
    (body,) = srv.bodies
    assert body["chat_template_kwargs"] == {"enable_thinking": False} and body["max_tokens"] == 4096
    assert body["messages"][0] == {"role": "system", "content": vlm_trm_prompts.T2I_SYSTEM}
    served = to_chat_request(body, max_top_logprobs=0)
    assert served.template_kwargs == {"enable_thinking": False} and served.messages[0]["role"] == "system"
    for bad in ({"chat_template": "{{ evil }}"}, {"enable_thinking": "yes"}, ["enable_thinking"]):
        with pytest.raises(BadRequest, match="chat_template_kwargs"):
            to_chat_request({**body, "chat_template_kwargs": bad}, max_top_logprobs=0)
