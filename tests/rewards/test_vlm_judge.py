"""VLM judges (docs/methods/vlm_judges.md) on a tiny random Qwen2.5-VL built offline.

The parser, the weighted-score arithmetic and the rubric reading are checked on tables of replies;
the judge itself runs the real transformers model: weighted scores against a direct forward pass,
range, determinism at temperature 0, batching, rubric caching, videos and failure handling.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

import rewards
from flowalign.errors import UserError
from rewards.vlm_judge import FALLBACK_RUBRIC, LocalVLMJudge
from rewards.vlm_parse import (Criterion, choice_from_text, choice_probs, parse_rubric, parse_score, rubric_reward,
                               weighted_score)

ALL = 10_000  # top_logprobs covering the tiny vocabulary: the weighted score is then exact


@pytest.fixture(scope="module")
def judge(vlm_dir: Path) -> LocalVLMJudge:
    return LocalVLMJudge(str(vlm_dir), mode="weighted", top_logprobs=ALL)


def smooth_images(n: int, size: int = 64, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    coarse = torch.rand(n, 3, 8, 8, generator=g)
    return torch.nn.functional.interpolate(coarse, size=(size, size), mode="bilinear", align_corners=False)


class Spy:
    """Calls through to the real backend and records the requests it was given."""

    def __init__(self, backend):
        self.backend, self.calls = backend, []

    def complete(self, requests):
        self.calls.append(list(requests))
        return self.backend.complete(requests)


# --------------------------------------------------------------------------------------------------
# Parsing (pure)
# --------------------------------------------------------------------------------------------------

PARSE_TABLE = [
    # reply, labels, scale, expected score (None: invalid)
    ("Score: 4", ("Score",), (1, 5), 4.0),
    ("score:4.5", ("Score",), (1, 5), 4.5),
    ("**Score:** 3", ("Score",), (1, 5), 3.0),
    ("The image is good.\nScore = 5", ("Score",), (1, 5), 5.0),
    ("Final Score: 7/10", ("Score",), (1, 10), 7.0),
    ("Score: 0.8/1", ("Score",), (1, 10), 8.0),
    ("Alignment Score (1-5): 4\nCoherence Score (1-5): 2\nStyle Score (1-5): 3",
     ("Alignment", "Coherence", "Style"), (1, 5), 3.0),
    ("alignment score (1 to 5): 5, coherence: 3", ("Alignment", "Coherence"), (1, 5), 4.0),
    ("<think>Score: 1 would be too harsh, maybe 2</think><answer>4</answer>", ("Score",), (1, 5), 4.0),
    ("<think>the circle is red, 3 objects</think> I give it 5", ("Score",), (1, 5), 5.0),
    ("I'd say 3 out of 5.", ("Score",), (1, 5), 3.0),
    ("4", ("Score",), (1, 5), 4.0),
    ("Rating: 6", ("Score",), (1, 5), None),          # fallback number outside the scale
    ("Score: 0", ("Score",), (1, 5), None),           # label outside the scale: not clipped
    ("The image matches the prompt well.", ("Score",), (1, 5), None),
    ("", ("Score",), (1, 5), None),
    (None, ("Score",), (1, 5), None),
    ("<think>maybe 4</think>", ("Score",), (1, 5), None),  # a number only inside the reasoning
    ("<answer>excellent</answer> 4", ("Score",), (1, 5), None),  # the answer block holds no number
]


@pytest.mark.parametrize("reply,labels,scale,expected", PARSE_TABLE)
def test_parse_score_table(reply, labels, scale, expected):
    parsed = parse_score(reply, labels, scale)
    if expected is None:
        assert parsed.score is None and parsed.reason, parsed
    else:
        assert parsed.score == pytest.approx(expected), (reply, parsed)


def test_parse_score_require_all_names_the_missing_label():
    parsed = parse_score("Alignment: 4", ("Alignment", "Style"), (1, 5), require_all=True)
    assert parsed.score is None and "Style" in parsed.reason


def test_choice_probs_pools_leading_space_variants_and_skips_whitespace():
    lp = math.log
    # "7" and " 7" are one answer; "x" is not a digit and is ignored
    probs, mass, _ = choice_probs([[("x", lp(0.4)), ("3", lp(0.3)), ("7", lp(0.2)), (" 7", lp(0.1))]], ["x"],
                                  [str(k) for k in range(1, 10)])
    assert probs[6] == pytest.approx(0.5) and probs[2] == pytest.approx(0.5) and mass == pytest.approx(0.6)
    # Qwen style: greedy took a lone space first; the digits are read at the next position, weighted by it
    positions = [[(" ", lp(0.8)), ("2", lp(0.2))], [("4", lp(0.75)), ("2", lp(0.25))]]
    probs, mass, _ = choice_probs(positions, [" ", "4"], ["1", "2", "3", "4"])
    expected = torch.tensor([0.0, 0.2 + 0.8 * 0.25, 0.0, 0.8 * 0.75])
    assert torch.allclose(torch.tensor(probs), expected / expected.sum())
    assert weighted_score(probs) == pytest.approx(float((torch.arange(1, 5) * expected).sum() / expected.sum()))
    # no digit anywhere: no score (not 0)
    probs, mass, reason = choice_probs([[("a", lp(0.9))]], ["a"], ["1", "2"])
    assert probs is None and mass == 0 and reason


def test_choice_from_text():
    assert choice_from_text(" Yes, it matches.", ["yes", "no"])[0] == [1.0, 0.0]
    assert choice_from_text("2", ["1", "2"])[0] == [0.0, 1.0]
    assert choice_from_text("1.5 maybe", ["1", "2"])[0] is None
    assert choice_from_text("Nope", ["yes", "no"])[0] is None


def test_parse_rubric():
    text = ('Here it is:\n```json\n[{"name": "colour", "description": "red", "weight": 2},'
            ' {"name": "shape", "description": "circle", "weight": 2}]\n```')
    rubric, _ = parse_rubric(text)
    assert [c.name for c in rubric] == ["colour", "shape"] and [c.weight for c in rubric] == [0.5, 0.5]
    rubric, _ = parse_rubric('{"criteria": [{"name": "a"}, {"name": "b"}, {"name": "c"}]}')
    assert [c.weight for c in rubric] == pytest.approx([1 / 3] * 3)
    for bad in ("no json here", '[{"description": "no name"}]', '[{"name": "a", "weight": -1}]',
                '[{"name": "a", "weight": "heavy"}]', '[{"name": "a"}, {"name": "A"}]', "[]", None):
        rubric, reason = parse_rubric(bad)
        assert rubric is None and reason, bad


def test_rubric_reward_is_the_weighted_mean_over_ten():
    rubric = [Criterion("colour", "", 0.25), Criterion("shape", "", 0.75)]
    assert rubric_reward(rubric, {"colour": 10, "shape": 2}) == pytest.approx(0.25 + 0.75 * 0.2)
    assert rubric_reward(rubric, {"colour": 0, "shape": 0}) == 0 and rubric_reward(rubric, {"colour": 10, "shape": 10}) == 1


# --------------------------------------------------------------------------------------------------
# The tiny VLM
# --------------------------------------------------------------------------------------------------


def test_tiny_vlm_loads_with_auto_classes(vlm_dir: Path):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model = AutoModelForImageTextToText.from_pretrained(vlm_dir)
    processor = AutoProcessor.from_pretrained(vlm_dir)
    assert type(model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    tok = processor.tokenizer
    for word in ("Score", " Yes", " No", "<|im_start|>", "<|image_pad|>", *"123456789"):
        assert len(tok(word, add_special_tokens=False)["input_ids"]) == 1, word
    assert model.config.image_token_id == tok.convert_tokens_to_ids("<|image_pad|>")
    assert "<|im_start|>assistant" in processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "text", "text": "hi"}]}], add_generation_prompt=True, tokenize=False)


def test_qwen3_vl_judge(tmp_path: Path):
    """The same judge code on the other model class the method page names (Qwen3-VL: deepstack, 16 px patches)."""
    from rewards.vlm_tiny import build_tiny_vlm

    build_tiny_vlm(tmp_path, family="qwen3_vl")
    j = LocalVLMJudge(str(tmp_path), mode="weighted", scale=5, top_logprobs=ALL)
    assert type(j.backend.model).__name__ == "Qwen3VLForConditionalGeneration"
    a, b = j(smooth_images(2), ["a red circle"] * 2, []), j(smooth_images(2), ["a red circle"] * 2, [])
    s = a.components["vlm_judge"]
    assert a.valid.all() and ((s >= 1) & (s <= 5)).all() and torch.equal(s, b.components["vlm_judge"])


# --------------------------------------------------------------------------------------------------
# Local judge
# --------------------------------------------------------------------------------------------------


def test_weighted_score_matches_a_direct_forward_pass(judge: LocalVLMJudge):
    """s = Σ k·p_k with p the softmax over the digit tokens only, from the model's own next-token logits."""
    images = smooth_images(3)
    prompts = ["a red circle", "two blue squares", "a green star"]
    out = judge(images, prompts, [])
    assert out.valid.all()
    vlm = judge.backend
    digit_ids = [vlm.tokenizer.convert_tokens_to_ids(str(k)) for k in range(1, 10)]
    for i in range(3):
        request = judge._weighted_request(judge._media(images[i]), prompts[i])
        inputs = vlm.processor(text=[vlm.render(request)], images=[request.messages[0]["content"][0]["image"]],
                               return_tensors="pt")
        with torch.no_grad():
            logits = vlm.model(**inputs).logits[0, -1].float()
        assert vlm.token_text(int(logits.argmax())).strip() != ""  # the digits are read at position 0 here
        p = torch.softmax(logits[digit_ids], 0)
        assert torch.allclose(torch.tensor(out.info[i]["probs"], dtype=torch.float64), p.double(), atol=1e-5)
        assert out.components["vlm_judge"][i].item() == pytest.approx((torch.arange(1, 10) * p).sum().item(), abs=1e-4)


def test_digits_after_a_lone_space_token_are_read_one_position_later(vlm_dir: Path):
    """Qwen writes "Score: 7" as ":" "Ġ" "7". Raise the tiny judge's "Ġ" logit after "Score:" so that greedy
    decoding takes it; the score must then be P(k) ∝ P₀(k) + P₀(Ġ)·P₁(k), checked against two direct
    forward passes."""
    j = LocalVLMJudge(str(vlm_dir), mode="weighted", top_logprobs=ALL)
    vlm = j.backend
    request = j._weighted_request(j._media(smooth_images(1)[0]), "a red circle")
    image = request.messages[0]["content"][0]["image"]
    ws = vlm.tokenizer.convert_tokens_to_ids("Ġ")
    digits = [vlm.tokenizer.convert_tokens_to_ids(str(k)) for k in range(1, 10)]

    def next_token(text: str) -> tuple[torch.Tensor, torch.Tensor]:
        seen = {}

        def keep_input(module, args, output) -> None:  # the final hidden state the logits are read from
            seen["h"] = args[0].reshape(-1, args[0].shape[-1])[-1]

        hook = vlm.model.lm_head.register_forward_hook(keep_input)
        with torch.no_grad():
            logits = vlm.model(**vlm.processor(text=[text], images=[image], return_tensors="pt")).logits[0, -1]
        hook.remove()
        return torch.softmax(logits.float(), 0), seen["h"]

    prompt = vlm.render(request)
    assert prompt.endswith("Score:")
    _, h = next_token(prompt)
    with torch.no_grad():
        vlm.model.lm_head.weight[ws] += 20 * h / h.norm() ** 2  # +20 on the "Ġ" logit at this position
    p0, _ = next_token(prompt)
    p1, _ = next_token(prompt + " ")
    assert int(p0.argmax()) == ws
    mass = p0[digits] + p0[ws] * p1[digits]
    out = j(smooth_images(1), ["a red circle"], [])
    assert out.valid.all()
    assert torch.allclose(torch.tensor(out.info[0]["probs"]), (mass / mass.sum()).double().float(), atol=1e-5)
    assert out.info[0]["choice_mass"] == pytest.approx(mass.sum().item(), rel=1e-4)


@pytest.mark.parametrize("scale", [2, 5, 9])
def test_weighted_scores_lie_in_1_to_K(vlm_dir: Path, scale: int):
    j = LocalVLMJudge(str(vlm_dir), mode="weighted", scale=scale, top_logprobs=ALL)
    out = j(smooth_images(4, seed=scale), ["a red circle"] * 4, [])
    s = out.components["vlm_judge"]
    assert out.valid.all() and (s >= 1).all() and (s <= scale).all()
    assert all(sum(info["probs"]) == pytest.approx(1.0) and len(info["probs"]) == scale for info in out.info)


def test_temperature_zero_is_deterministic_and_batch_independent(judge: LocalVLMJudge, vlm_dir: Path):
    images, prompts = smooth_images(4, seed=1), ["a red circle", "a red circle", "a blue square", "a star"]
    a, b = judge(images, prompts, []), judge(images, prompts, [])
    assert torch.equal(a.components["vlm_judge"], b.components["vlm_judge"])
    alone = torch.cat([judge(images[i : i + 1], prompts[i : i + 1], []).components["vlm_judge"] for i in range(4)])
    # left padding in a batch must not change a sample's score
    assert torch.allclose(alone, a.components["vlm_judge"], atol=1e-4)
    text = LocalVLMJudge(str(vlm_dir), mode="text", max_tokens=12, temperature=0.0)
    r1, r2 = text(images, prompts, []), text(images, prompts, [])
    assert [x["reply"] for x in r1.info] == [x["reply"] for x in r2.info]


def test_yesno_is_a_probability(vlm_dir: Path):
    j = LocalVLMJudge(str(vlm_dir), mode="yesno", top_logprobs=ALL)
    out = j(smooth_images(3), ["a red circle"] * 3, [])
    s = out.components["vlm_judge"]
    assert out.valid.all() and (s > 0).all() and (s < 1).all()
    assert all(info["probs"][0] == pytest.approx(x) for info, x in zip(out.info, s.tolist()))


def test_digits_outside_top_logprobs_make_the_sample_invalid_not_zero(vlm_dir: Path):
    j = LocalVLMJudge(str(vlm_dir), mode="weighted", top_logprobs=1)
    out = j(smooth_images(2), ["a red circle"] * 2, [])
    assert not out.valid.any() and torch.isnan(out.components["vlm_judge"]).all()
    assert "not a score" in out.info[0]["reason"] and j.stats["parse_failures"] == 2 and j.stats["invalid"] == 2


def test_a_reply_that_is_not_a_score_is_invalid_and_counted(vlm_dir: Path):
    """The random tiny judge writes gibberish: every sample is invalid with its reason, none scored 0."""
    j = LocalVLMJudge(str(vlm_dir), mode="text", max_tokens=8)
    out = j(smooth_images(3), ["a red circle"] * 3, [])
    assert not out.valid.any() and torch.isnan(out.components["vlm_judge"]).all()
    assert j.stats["parse_failures"] == 3 and all("not a score" in x["reason"] and "reply" in x for x in out.info)


def test_rubric_once_per_prompt_for_a_whole_group(vlm_dir: Path):
    j = LocalVLMJudge(str(vlm_dir), mode="rubric", max_tokens=8, rubric_tokens=24)
    spy = j.backend = Spy(j.backend)
    prompts = ["a red circle"] * 3 + ["a blue square"] * 3  # two GRPO groups of 3
    out = j(smooth_images(6), prompts, [])
    rubric_requests = [r for call in spy.calls for r in call if "rubric" in r.messages[0]["content"][-1]["text"]
                       and "JSON" in r.messages[0]["content"][-1]["text"]]
    assert len(rubric_requests) == 2 and j.stats["rubric_calls"] == 2
    # the same rubric for every member of a group (the tiny judge's JSON is unreadable: the fallback, cached)
    assert all(info["rubric"] == out.info[0]["rubric"] for info in out.info[:3])
    assert j.rubrics["a red circle"] == FALLBACK_RUBRIC and j.stats["rubric_failures"] == 2
    n_calls = len(spy.calls)
    j(smooth_images(6, seed=3), prompts, [])
    assert j.stats["rubric_calls"] == 2 and len(spy.calls) == n_calls + 1  # only the scoring call
    j.rubrics["a red circle"] = [Criterion("colour", "", 0.5), Criterion("shape", "", 0.5)]  # a known rubric
    j(smooth_images(3), prompts[:3], [])
    assert "colour (weight 0.50)" in spy.calls[-1][0].messages[0]["content"][-1]["text"]


def test_pairwise_win_rates(vlm_dir: Path):
    j = LocalVLMJudge(str(vlm_dir), mode="pairwise", top_logprobs=ALL)
    spy = j.backend = Spy(j.backend)
    out = j(smooth_images(4), ["a red circle"] * 3 + ["alone"], [])
    assert len(spy.calls[0]) == 6  # 3 samples, both orders of each pair
    s = out.components["vlm_judge"]
    assert out.valid[:3].all() and not out.valid[3] and "2 samples" in out.info[3]["reason"]
    # a group's win probabilities are zero-sum around 1/2
    assert s[:3].mean().item() == pytest.approx(0.5, abs=1e-6) and ((s[:3] >= 0) & (s[:3] <= 1)).all()


def test_videos_are_judged_on_sampled_frames(judge: LocalVLMJudge):
    spy = Spy(judge.backend)
    judge.backend = spy
    try:
        video = torch.rand(2, 9, 3, 64, 64)
        out = judge(video, ["a red circle moves right"] * 2, [])
    finally:
        judge.backend = spy.backend
    assert out.valid.all() and ((out.components["vlm_judge"] >= 1) & (out.components["vlm_judge"] <= 9)).all()
    parts = spy.calls[0][0].messages[0]["content"]
    assert sum(p["type"] == "image" for p in parts) == judge.num_frames and "video" in parts[-1]["text"]


def test_images_are_resized_by_the_processor_not_by_hand(judge: LocalVLMJudge):
    spy = Spy(judge.backend)
    judge.backend = spy
    try:
        out = judge(smooth_images(1, size=128), ["a red circle"], [])
    finally:
        judge.backend = spy.backend
    image = spy.calls[0][0].messages[0]["content"][0]["image"]
    assert out.valid.all() and image.size == (128, 128)  # handed over at full resolution
    grid = judge.backend.processor.image_processor(images=[image], return_tensors="pt")["image_grid_thw"]
    assert grid.tolist() == [[1, 4, 4]]  # the processor's max_pixels (56x56 for the tiny judge) applies


def test_nan_sample_is_invalid_alone(judge: LocalVLMJudge):
    images = smooth_images(3)
    images[1, 0, 0, 0] = float("nan")
    out = judge(images, ["a"] * 3, [])
    assert out.valid.tolist() == [True, False, True] and "NaN" in out.info[1]["reason"]


def test_registry_and_bad_input(vlm_dir: Path, tmp_path: Path):
    j = rewards.load("vlm_judge", model=str(vlm_dir), top_logprobs=ALL)
    assert isinstance(j, LocalVLMJudge)
    with pytest.raises(UserError, match="not a model folder"):
        rewards.load("vlm_judge", model=str(tmp_path / "missing"))
    with pytest.raises(UserError, match="mode="):
        LocalVLMJudge(str(vlm_dir), mode="weigthed")
    with pytest.raises(UserError, match="scale="):
        LocalVLMJudge(str(vlm_dir), scale=10)
    with pytest.raises(UserError, match="max_tokens=True must be an integer"):  # YAML's true is not 1 token
        LocalVLMJudge(str(vlm_dir), mode="text", max_tokens=True)
    with pytest.raises(UserError, match="question"):
        LocalVLMJudge(str(vlm_dir), question="Rate this image")
    with pytest.raises(UserError, match="placeholder"):
        LocalVLMJudge(str(vlm_dir), question='Rate {prompt} as {"score": x}')
    with pytest.raises(UserError, match="prefix="):
        LocalVLMJudge(str(vlm_dir), prefix="{score}:")
    with pytest.raises(UserError, match="labels"):
        LocalVLMJudge(str(vlm_dir), mode="text", labels="Score")
    with pytest.raises(UserError, match=r"\[0, 1\]"):
        j(smooth_images(1) * 255, ["a"], [])
    with pytest.raises(UserError, match="prompts"):
        j(smooth_images(2), ["a"], [])
    with pytest.raises(UserError, match="url="):
        rewards.load("vlm_judge_http", url="localhost:8000")
    with pytest.raises(UserError, match="timeout="):
        rewards.load("vlm_judge_http", url="http://127.0.0.1:1/v1", timeout=0)


# --------------------------------------------------------------------------------------------------
# Thinking judge (TRM): rubric → assessment → score
# --------------------------------------------------------------------------------------------------

THINK_TABLE = [
    # reply, expected verdict on 0..10 (None: invalid)
    ("Assessment:\n- colour: the circle is red.\n- shape: round, as asked.\nScore: 8", 8.0),
    ("**Assessment:** the shape is a square, not a circle; colour right.\n**Score:** 3.5", 3.5),
    # the assessment mentions per-criterion numbers; the verdict is the last score
    ("Assessment: colour score is 9, shape score is 2, so overall weak.\nFinal Score: 4/10", 4.0),
    ("<think>The rubric asks for a red circle. The image shows a red disc.</think>Score: 9", 9.0),
    ("Score: 7", None),  # a verdict without reasoning: not this mode's reply
    ("Assessment: the circle is red and round.", None),  # no verdict
    ("Assessment:\nScore: 6", None),  # an empty assessment
    ("Assessment: nothing matches.\nScore: 12", None),  # outside 0..10
    ("", None),
    ("The image has 2 circles, it looks fine", None),
]


@pytest.mark.parametrize("reply,expected", THINK_TABLE)
def test_parse_thinking(reply, expected):
    from rewards.vlm_parse import parse_thinking

    parsed = parse_thinking(reply)
    if expected is None:
        assert not parsed.ok and parsed.reason, reply
    else:
        assert parsed.ok and parsed.score == pytest.approx(expected) and parsed.assessment, reply


class Recorded:
    """A backend replaying recorded replies in order; keeps the requests it was given."""

    def __init__(self, replies):
        from rewards.vlm_backend import Completion

        self.replies = [Completion(text=r) if isinstance(r, str) else r for r in replies]
        self.calls = []

    def complete(self, requests):
        self.calls.append(list(requests))
        out, self.replies = self.replies[: len(requests)], self.replies[len(requests):]
        return out


def test_think_mode_writes_the_rubric_once_then_assesses_each_sample_against_it():
    from rewards.vlm_backend import Completion
    from rewards.vlm_judge import VLMJudge

    rubric = '[{"name": "colour", "description": "is it red", "weight": 0.5}, {"name": "shape", "weight": 0.5}]'
    replies = [rubric,
               "Assessment:\n- colour: red.\n- shape: a circle.\nScore: 9",
               "Assessment: colour wrong (blue), shape right.\nScore: 5",
               "It looks good. 7",  # no assessment, no verdict: invalid, not 0
               Completion(text=None, error="timeout")]
    j = VLMJudge(Recorded(replies), mode="think")
    out = j(smooth_images(4), ["a red circle"] * 4, [])
    calls = j.backend.calls
    assert [len(c) for c in calls] == [1, 4]  # one rubric call for the group, then one call per sample
    assert "JSON" in calls[0][0].messages[0]["content"][-1]["text"]
    assess = calls[1][0].messages[0]["content"][-1]["text"]
    assert "colour (weight 0.50): is it red" in assess and "Assessment:" in assess and "Score: x" in assess
    s = out.components["vlm_judge"]
    assert out.valid.tolist() == [True, True, False, False]
    assert s[:2].tolist() == pytest.approx([0.9, 0.5]) and torch.isnan(s[2:]).all()
    assert "assessment" in out.info[2]["reason"] and "timeout" in out.info[3]["reason"]
    assert out.info[0]["assessment"].startswith("- colour: red") and out.info[0]["verdict"] == 9
    assert j.stats["parse_failures"] == 1 and j.stats["call_failures"] == 1 and j.stats["rubric_calls"] == 1


def test_think_mode_on_the_tiny_vlm(vlm_dir: Path):
    """The real model path: the random tiny judge's gibberish is no assessment, so every sample is invalid
    with its reason (none scored 0), and a group shares one rubric call."""
    j = LocalVLMJudge(str(vlm_dir), mode="think", max_tokens=8, rubric_tokens=16)
    out = j(smooth_images(3), ["a red circle"] * 3, [])
    assert j.stats["rubric_calls"] == 1 and not out.valid.any()
    assert torch.isnan(out.components["vlm_judge"]).all()
    assert all("not a score" in x["reason"] and "reply" in x for x in out.info)
