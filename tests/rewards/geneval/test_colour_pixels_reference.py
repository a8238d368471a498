"""The colour step's CLIP input against GenEval's own (known answers).

``known_answers/geneval_colour_pixels.json`` holds what GenEval's ``ImageCrops`` (djghosh13/geneval@af4902f,
run unchanged) hands its CLIP for five detections of a fixed 512² scene: each object pasted through its mask on
#999, cropped to its box and put through open_clip's ViT-L-14 evaluation transform, as GenEval's ``load_models``
and Flow-GRPO's reward server build it (provenance inside). The crops themselves are checked equal in
``test_rules_reference.py``; this checks the pixels CLIP reads from them, at ViT-L/14's 224 px.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer, CLIPImageProcessor, CLIPProcessor

from rewards.geneval.colour import ClipColours
from rewards.geneval.rules import Detection

ANSWERS = json.loads((Path(__file__).parent / "known_answers" / "geneval_colour_pixels.json").read_text())
CASES = {case["name"]: case for case in ANSWERS["cases"]}
W = H = 512
TINY_CLIP = Path(__file__).parents[3] / "assets" / "tiny-rewards" / "geneval" / "clip"  # its CLIP tokenizer
#: openai/clip-vit-large-patch14's preprocessor_config.json (GenEval's CLIP as transformers ships it)
VIT_L_14 = dict(size={"shortest_edge": 224}, crop_size={"height": 224, "width": 224}, resample=3,
                image_mean=[0.48145466, 0.4578275, 0.40821073], image_std=[0.26862954, 0.26130258, 0.27577711])


def scene() -> np.ndarray:
    """The provenance's scene, ``(512, 512, 3)`` uint8."""
    y, x = np.mgrid[0:H, 0:W].astype(np.float64)
    img = np.stack([128 + 100 * np.sin(x / 37.0 + y / 91.0), 128 + 100 * np.cos(y / 23.0), (x * 0.4 + y * 0.3) % 256], -1)
    img[(x - 120) ** 2 + (y - 90) ** 2 < 45 ** 2] = (220, 40, 40)
    img[(x > 300) & (x < 420) & (y > 260) & (y < 330)] = (30, 60, 210)
    return np.clip(np.round(img), 0, 255).astype(np.uint8)


def ellipse(cx: float, cy: float, rx: float, ry: float) -> np.ndarray:
    y, x = np.mgrid[0:H, 0:W]
    return ((x - cx) / rx) ** 2 + ((y - cy) / ry) ** 2 <= 1


class RecordingClip:
    """Stands in for the CLIP model only: records the pixels it is handed."""

    device, dtype = torch.device("cpu"), torch.float32

    def __init__(self):
        self.pixels = None

    def get_image_features(self, pixel_values):
        self.pixels = pixel_values
        return SimpleNamespace(pooler_output=torch.ones(pixel_values.shape[0], 4))


def clip_input(name: str, preprocess: str) -> torch.Tensor:
    """The ``(3, 224, 224)`` pixels ``ClipColours`` gives its CLIP for the case's detection."""
    case = CASES[name]
    colours = ClipColours.__new__(ClipColours)
    colours.model, colours.preprocess = RecordingClip(), preprocess
    colours.processor = CLIPProcessor(image_processor=CLIPImageProcessor(**VIT_L_14),
                                      tokenizer=AutoTokenizer.from_pretrained(TINY_CLIP))
    colours._heads = {"car": torch.nn.functional.normalize(torch.ones(10, 4), dim=-1)}
    mask = None if case["mask"] is None else ellipse(*case["mask"])
    colours(scene(), "car", [Detection("car", 0.9, tuple(np.float32(case["box"]).tolist()), mask)])
    return colours.model.pixels[0]


@pytest.mark.parametrize("name", list(CASES))
def test_colour_crops_reach_clip_as_genevals_transform_makes_them(name):
    case = CASES[name]
    pixels = clip_input(name, "open_clip")
    assert tuple(pixels.shape) == (3, 224, 224)
    np.testing.assert_allclose(pixels.double().sum((1, 2)).numpy(), case["channel_sums"], rtol=1e-6, atol=1e-3)
    np.testing.assert_allclose(pixels[:, ::16, ::16].numpy(), case["every_16th"], atol=1e-5)


def test_the_former_processor_form_is_a_pixel_off_where_half_the_margin_rounds():
    """transformers' processor (the former form) floors half the margin where open_clip (torchvision) rounds
    it: a 100 × 61 crop resized to 367 × 224 (margin 143) and a 64 × 170 one resized to 224 × 595 (margin 371)
    come out one column / one row off GenEval's, within one 8-bit level once shifted back; the crops with an
    even margin differ by at most one 8-bit level (a float resize against PIL's 8-bit one)."""
    level = 1 / 255 / min(VIT_L_14["image_std"]) + 1e-4
    for name, shift in (("box_only_upscaled_odd_margin", (slice(None), slice(None), slice(1, None))),
                        ("masked_tall", (slice(None), slice(1, None), slice(None)))):
        former, theirs = clip_input(name, "processor"), clip_input(name, "open_clip")
        assert (former - theirs).abs().max() > level
        back = tuple(slice(None, -1) if s.start == 1 else s for s in shift)
        assert (former[shift] - theirs[back]).abs().max() <= level
    for name in ("masked_upscaled", "box_only_downscaled"):
        assert 1e-3 < (clip_input(name, "processor") - clip_input(name, "open_clip")).abs().max() <= level
