"""The colour step's CLIP against GenEval's own (known answers): open_clip's model and tokenizer and
clip_benchmark's zero-shot head, as GenEval's ``color_classification`` calls them, against flowalign's
:class:`ClipColours` on transformers' ``CLIPModel`` with the same weights.

``known_answers/geneval_colour_clip.json`` holds, for six GenEval classes (the two-word ones among them), the
zero-shot head clip_benchmark 1.6.2's ``zero_shot_classifier`` builds from GenEval's three templates and the
logits its ``run_classification`` gives four crops, on :mod:`tests.rewards.geneval.tiny_openai_clip`'s checkpoint
read by open_clip's ``load_openai_model`` (what ``pretrained="openai"`` loads) through its evaluation transform
(provenance inside). The transformers folder holds the same tensors under transformers' names and the real CLIP
BPE vocabulary; the tokenizers are compared on every prompt GenEval's colour step writes.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from rewards.geneval.colour import TEMPLATES, ClipColours, crop_pixels
from rewards.geneval.vocabulary import CLASSES, COLOURS
from tests.rewards.geneval.tiny_openai_clip import openai_state_dict, save_transformers_folder

ANSWERS = json.loads((Path(__file__).parent / "known_answers" / "geneval_colour_clip.json").read_text())


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return save_transformers_folder(openai_state_dict(0), tmp_path_factory.mktemp("openai-clip"))


def crops() -> list[Image.Image]:
    rng = np.random.RandomState(0)
    return [Image.fromarray((rng.rand(*case["size_hw"], 3) * 255).astype(np.uint8)) for case in ANSWERS["crops"]]


def test_every_colour_prompt_tokenizes_as_open_clips_tokenizer(folder):
    """GenEval tokenizes with ``open_clip.get_tokenizer("ViT-L-14")``; transformers' CLIP tokenizer on the same BPE
    gives the same ids up to the end token for all 2400 prompts (80 classes × 10 colours × 3 templates)."""
    import open_clip
    from transformers import AutoTokenizer

    texts = [t.format(c=c, cls=cls) for cls in CLASSES for c in COLOURS for t in TEMPLATES]
    theirs = open_clip.get_tokenizer("ViT-L-14")(texts)
    ours = AutoTokenizer.from_pretrained(folder)(texts)["input_ids"]
    assert len(CLASSES) == 80
    for text, row, ids in zip(texts, theirs.tolist(), ours):
        assert row[: row.index(49407) + 1] == ids, text


def test_the_colour_head_and_logits_equal_genevals_open_clip_and_clip_benchmark(folder):
    colours = ClipColours(folder, torch.float32)
    pixels = crop_pixels(crops(), colours.processor, "open_clip")
    with torch.no_grad():
        feats = colours.model.get_image_features(pixel_values=pixels).pooler_output
    image = torch.nn.functional.normalize(feats, dim=-1)
    for cls, known in ANSWERS["classes"].items():
        head = colours._head(cls)
        torch.testing.assert_close(head, torch.tensor(known["classifier"]), rtol=0, atol=1e-6)
        logits = 100 * image @ head.T  # clip_benchmark's run_classification
        torch.testing.assert_close(logits, torch.tensor(known["logits"]), rtol=0, atol=5e-5)  # 1e-5 seen
        assert [COLOURS[i] for i in logits.argmax(-1).tolist()] == known["colours"]
