"""``geneval``'s rules against GenEval's own evaluator and Flow-GRPO's reward server (known answers).

References, run on the hand-built cases kept in ``known_answers/geneval_rules_reference.json`` (provenance
inside):

* djghosh13/geneval@af4902f ``evaluation/evaluate_images.py``: ``evaluate_image`` (the per-class confidence bar,
  0.3 or 0.9 for ``counting``, strictly above, on mmdetection's float32 scores; most confident first by
  ``np.argsort``; at most ``MAX_OBJECTS``; greedy NMS with ``compute_iou`` when ``max_overlap`` < 1),
  ``evaluate`` (the verdict and its reason lines), ``relative_position``, ``color_classification`` and
  ``ImageCrops`` (the object pasted through its mask on ``#999``, cropped to its box);
* clip-benchmark 1.4.0 (GenEval's pin) ``zero_shot_classifier`` / ``run_classification``;
* yifan123/reward-server@92ac29f ``reward_server/gen_eval.py``: ``compute_geneval`` → ``evaluate_reward``, whose
  ``scores`` yifan123/flow_grpo@ac4c86e ``flow_grpo/rewards.py`` (``geneval_score``, ``multi_score``) puts
  under ``geneval`` and sums into ``avg``, the reward its GRPO advantages are computed from; its
  ``strict_rewards`` are what Flow-GRPO logs as ``strict_accuracy``.

Their code ran in Python 3.11 with numpy 1.23.5 and Pillow 9.4.0 (GenEval's environment pins numpy 1.23.1 and
Pillow 9.4.0). Stubbed: mmdetection (``inference_detector`` returned each case's detections as per-class
``(k, 5)`` float32 arrays), ``open_clip`` and ``pandas`` (import-time only), and ``torch.cuda.is_available``
while their module was imported (it asserts a CUDA device). For the rule cases the two clip_benchmark calls
were replaced by a lookup of each case's colours by box, so both sides see the same colour verdicts; for the
colour cases the real clip_benchmark functions and their ``ImageCrops`` ran on a fake CLIP (``fake_clip``
below, the same numbers on both sides), which checks the prompts, the zero-shot head, the crops and the argmax.

Where flowalign departs on purpose (each pinned below): a box under one pixel wide is cropped to one pixel
(their crop is empty and CLIP's preprocessing cannot take it), and the reason naming two relations lists
them in a fixed order (theirs joins a Python set).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from rewards.geneval.colour import ClipColours
from rewards.geneval.reward import GenEvalReward
from rewards.geneval.rules import Detection, judge, relative_position, select_objects

ANSWERS = json.loads((Path(__file__).parent / "known_answers" / "geneval_rules_reference.json").read_text())
RULES = {case["name"]: case for case in ANSWERS["rules"]}
COLOUR_CASES = {case["name"]: case for case in ANSWERS["colour"]}


def key(box):
    return tuple(round(float(v), 4) for v in box[:4])


def canonical(reason: str) -> str:
    """A reason line with the relations of "found A and B target" sorted (theirs come out of a set)."""
    found = re.fullmatch(r"(expected .* target, found )(.*)( target)", reason)
    if not found:
        return reason
    return found[1] + " and ".join(sorted(filter(None, found[2].split(" and ")))) + found[3]


def flowalign_verdict(case):
    detections = [Detection(d["label"], d["score"], tuple(d["box"])) for d in case["detections"]]
    options = case["options"]
    objects = select_objects(detections, case["metadata"]["tag"],
                             **{k: v for k, v in options.items() if k != "position_threshold"})
    table = {key(c["box"]): c["colour"] for c in case["colours"]}
    margin = {k: v for k, v in options.items() if k == "position_threshold"}
    verdict = judge(objects, case["metadata"], lambda cls, dets: [table[key(d.box)] for d in dets], **margin)
    return objects, verdict


@pytest.mark.parametrize("name", list(RULES))
def test_verdict_and_reasons_are_genevals(name):
    case = RULES[name]
    _, verdict = flowalign_verdict(case)
    assert verdict.correct == case["geneval"]["correct"]
    assert [canonical(r) for r in verdict.reasons] == [canonical(r) for r in case["geneval"]["reason"]]


@pytest.mark.parametrize("name", list(RULES))
def test_kept_objects_are_genevals(name):
    """Threshold (strict, in float32), the per-class cap, NMS, and the order (ties: the later detection first)."""
    case = RULES[name]
    objects, _ = flowalign_verdict(case)
    mine = {cls: [[*d.box, d.score] for d in dets] for cls, dets in objects.items()}
    theirs = case["geneval"]["kept"]
    assert set(mine) == set(theirs)
    for cls in theirs:
        assert np.array_equal(np.asarray(mine[cls], np.float32), np.asarray(theirs[cls], np.float32)), cls


@pytest.mark.parametrize("name", [n for n, c in RULES.items() if "reward_server" in c])
def test_partial_and_exact_are_the_reward_servers(name):
    """``partial`` is Flow-GRPO's training reward (their ``scores``), ``exact`` their ``strict_rewards``."""
    case = RULES[name]
    _, verdict = flowalign_verdict(case)
    server = case["reward_server"]
    assert verdict.partial == pytest.approx(server["score"], abs=1e-12)
    assert verdict.exact == server["strict_correct"]
    assert verdict.correct == server["correct"]  # the server's copy of GenEval's evaluate


def test_the_default_score_is_flow_grpos_training_reward():
    assert inspect.signature(GenEvalReward).parameters["score"].default == "partial"


@pytest.mark.parametrize("pair", ANSWERS["relative_position"], ids=lambda p: f"{p['a']}-{p['b']}-{p['margin']}")
def test_relative_position_is_genevals(pair):
    assert sorted(relative_position(pair["a"], pair["b"], pair["margin"])) == pair["relations"]


# ---- the colour step, on a fake CLIP ------------------------------------------------------------------

PROTO = {"red": (220, 30, 30), "orange": (240, 140, 20), "yellow": (235, 220, 40), "green": (40, 170, 60),
         "blue": (40, 60, 220), "purple": (130, 40, 180), "pink": (240, 140, 190), "brown": (120, 70, 30),
         "black": (15, 15, 15), "white": (245, 245, 245)}


def text_embedding(text: str) -> np.ndarray:
    """The fake CLIP's text embedding: the named colour's prototype plus noise seeded by the text."""
    colour = text[len("a photo of a "):].split(" ")[0].split("-")[0]
    seed = int(hashlib.sha256(text.encode()).hexdigest()[:8], 16)
    noise = np.random.RandomState(seed).standard_normal(3)
    return (np.asarray(PROTO[colour], np.float64) / 255 - 0.5 + 0.05 * noise).astype(np.float32)


def mean_rgb(image) -> torch.Tensor:
    return torch.from_numpy((np.asarray(image, np.float64).reshape(-1, 3).mean(0) / 255).astype(np.float32))


class FakeTokens(dict):
    def to(self, device):
        return self


class FakeProcessor:
    def __init__(self):
        self.texts, self.crops = [], []

    def __call__(self, text=None, images=None, **kwargs):
        if text is not None:
            self.texts += text
            return FakeTokens(texts=list(text))
        self.crops += images
        return {"pixel_values": torch.stack([mean_rgb(im) for im in images])}


class FakeClip:
    device, dtype = torch.device("cpu"), torch.float32

    def get_text_features(self, texts):
        return SimpleNamespace(pooler_output=torch.from_numpy(np.stack([text_embedding(t) for t in texts])))

    def get_image_features(self, pixel_values):
        return SimpleNamespace(pooler_output=pixel_values - 0.5)


def fake_clip():
    colours = ClipColours.__new__(ClipColours)
    colours.model, colours.processor, colours._heads = FakeClip(), FakeProcessor(), {}
    # the fake transform (mean RGB) runs through the processor path on both sides; the real transform, GenEval's
    # open_clip one, is checked in test_colour_pixels_reference.py
    colours.preprocess = "processor"
    return colours


def painted(spec) -> np.ndarray:
    w, h = spec["size"]
    pixels = np.zeros((h, w, 3), np.uint8)
    pixels[:] = spec["background"]
    for x0, y0, x1, y1, rgb in spec["paint"]:
        pixels[y0:y1, x0:x1] = rgb
    return pixels


def rect_mask(size, rects) -> np.ndarray:
    w, h = size
    mask = np.zeros((h, w), bool)
    for x0, y0, x1, y1 in rects:
        mask[y0:y1, x0:x1] = True
    return mask


@pytest.mark.parametrize("name", list(COLOUR_CASES))
def test_colour_step_is_genevals(name):
    """Their 30 prompts in their order, their zero-shot head, their crops (mask on #999, box rounded as PIL
    rounds it) and their colour names."""
    case = COLOUR_CASES[name]
    image = painted(case["image"])
    dets = [Detection(case["class"], 0.9, tuple(d["box"]),
                      None if d["mask"] is None else rect_mask(case["image"]["size"], d["mask"]))
            for d in case["detections"]]
    namer = fake_clip()
    named = namer(image, case["class"], dets)
    theirs = case["geneval"]
    assert namer.processor.texts == theirs["texts"]
    assert np.allclose(namer._head(case["class"]).numpy(), theirs["head"], atol=1e-6)
    assert [{"size": list(c.size), "sha256": hashlib.sha256(c.tobytes()).hexdigest()}
            for c in namer.processor.crops] == theirs["crops"]
    assert named == theirs["colours"]


def test_degenerate_box_is_one_pixel_wide_where_genevals_crop_is_empty():
    """A deliberate difference: their crop of a zero-width box is empty (CLIP's resize cannot take it);
    flowalign crops one pixel."""
    spec = ANSWERS["degenerate_crop"]
    assert spec["geneval_crop_size"][0] == 0
    namer = fake_clip()
    w, h = spec["image_size"]
    namer(np.zeros((h, w, 3), np.uint8), "cup", [Detection("cup", 0.9, tuple(spec["box"]))])
    assert namer.processor.crops[0].size == (1, spec["geneval_crop_size"][1])
