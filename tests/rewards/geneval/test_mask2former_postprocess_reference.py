"""Mask2Former's instance post-processing against mmdetection's, which GenEval's evaluator and Flow-GRPO's reward
server run: on fixed class and mask logits, the detector's detections (class, box, score, mask) equal what
mmdetection 2.28.2's ``MaskFormerFusionHead`` and ``bbox2result`` give (provenance in the JSON)."""

import json
from pathlib import Path

import pytest
import torch

from rewards.geneval.tiny import save_tiny_geneval
from rewards.geneval.detector import Mask2FormerDetector
from rewards.geneval.vocabulary import CLASSES

KNOWN = json.loads((Path(__file__).parent / "known_answers" / "geneval_mask2former_postprocess.json").read_text())


@pytest.fixture(scope="module")
def detector(tmp_path_factory):
    folders = save_tiny_geneval(tmp_path_factory.mktemp("tiny-geneval"))
    return Mask2FormerDetector(folders["path"], torch.float32)


@pytest.mark.parametrize("case", KNOWN["cases"], ids=lambda c: f"{c['queries']}q_" + "x".join(map(str, c["padded_hw"])))
def test_detections_equal_mmdetections_instance_postprocess(detector, case):
    found = detector._instances(torch.tensor(case["class_logits"]), torch.tensor(case["mask_logits"]),
                                tuple(case["scaled_hw"]), tuple(case["padded_hw"]), tuple(case["original_hw"]),
                                min_score=0.05)
    found = sorted(found, key=lambda d: -d.score)
    expected = case["detections"]
    assert len(found) == len(expected) > 10
    for det, (label, x0, y0, x1, y1, score) in zip(found, expected):
        assert det.label == CLASSES[label]
        assert det.score == pytest.approx(score, abs=1e-5)
        assert det.box == (x0, y0, x1, y1)
    areas = sorted(((CLASSES[label], score, pixels) for label, score, pixels in case["mask_areas"]), key=lambda r: -r[1])
    assert [(d.label, int(d.mask.sum())) for d in found] == [(label, pixels) for label, _, pixels in areas]
