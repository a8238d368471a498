"""GenEval's mmdetection Mask2Former converted into the geneval reward's detector folder
(``rewards/geneval/mmdet_checkpoint.py``, ``flowalign geneval-detector``): the converted network computes what
mmdetection 2.28.2's own model computes (``known_answers/mmdet_mask2former_tiny.json``: GenEval's config at
tiny widths, seeded weights, its head's last class and mask logits)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from flowalign.errors import UserError
from rewards.geneval.mmdet_checkpoint import _merge_order, convert_checkpoint, convert_state_dict

KNOWN = json.loads((Path(__file__).parent / "known_answers" / "mmdet_mask2former_tiny.json").read_text())


def seeded(keys: list) -> dict[str, torch.Tensor]:
    """The known answers' weights: in key order, 0.1·N(0, 1) from one generator seeded 0; a norm's 1-D weight
    1 + that (mmdetection's layout and names, ``relative_position_index`` left out: both codes rebuild it)."""
    g = torch.Generator().manual_seed(0)
    out = {}
    for key, shape in keys:
        value = torch.randn(shape, generator=g) * 0.1
        is_norm = (".norm" in key or ".gn." in key or "norms." in key or key.endswith("post_norm.weight")) \
            and key.endswith(".weight")
        out[key] = value + 1.0 if is_norm and len(shape) == 1 else value
    return out


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("mmdet") / "mask2former_tiny.pth"
    torch.save({"state_dict": seeded(KNOWN["keys"]), "meta": {"epoch": 50}}, path)
    return path


def test_the_converted_detector_computes_mmdetections_class_and_mask_logits(checkpoint, tmp_path):
    from transformers import Mask2FormerForUniversalSegmentation

    folder = convert_checkpoint(checkpoint, tmp_path / "detector")
    model = Mask2FormerForUniversalSegmentation.from_pretrained(folder).eval()
    image = torch.randn(1, 3, 224, 256, generator=torch.Generator().manual_seed(7))
    mask = torch.zeros(1, 224, 256, dtype=torch.long)
    mask[:, :200] = 1  # the image's 200 rows in a 224-row batch
    with torch.no_grad():
        out = model(pixel_values=image, pixel_mask=mask)
    classes, masks = out.class_queries_logits[0], out.masks_queries_logits[0]
    assert list(masks.shape) == KNOWN["mask_logits_shape"]
    torch.testing.assert_close(classes, torch.tensor(KNOWN["class_logits"]), atol=1e-4, rtol=0)
    torch.testing.assert_close(masks[:, ::4, ::4], torch.tensor(KNOWN["mask_logits_every_4th"]), atol=1e-4, rtol=0)
    torch.testing.assert_close(masks.mean((1, 2)), torch.tensor(KNOWN["mask_logits_query_means"]), atol=1e-4, rtol=0)


def test_patch_merging_reads_unfolds_channels_in_transformers_order():
    """mmdetection's ``nn.Unfold`` gathers a 2×2 patch channel-major (``c·4 + 2·kh + kw``); transformers concatenates
    the positions (0, 0), (1, 0), (0, 1), (1, 1): ``_merge_order`` maps the one onto the other."""
    x = torch.randn(1, 5, 4, 6)  # (B, C, H, W)
    unfolded = F.unfold(x, kernel_size=2, stride=2).transpose(1, 2)  # (B, patches, 4C)
    h = x.permute(0, 2, 3, 1)
    concatenated = torch.cat([h[:, 0::2, 0::2], h[:, 1::2, 0::2], h[:, 0::2, 1::2], h[:, 1::2, 1::2]], -1).flatten(1, 2)
    assert torch.equal(unfolded[..., _merge_order(5)], concatenated)


def test_the_folder_is_the_geneval_rewards_detector(checkpoint, tmp_path):
    from rewards.geneval.detector import MAX_PER_IMAGE, Mask2FormerDetector

    folder = convert_checkpoint(checkpoint, tmp_path / "detector")
    detector = Mask2FormerDetector(folder, torch.float32)
    image = (np.random.default_rng(0).random((240, 256, 3)) * 255).astype(np.uint8)
    found = detector([image], 0.0)[0]
    # at score 0 every one of its top (query, class) pairs, mmdetection's max_per_image; COCO's classes
    assert len(found) == MAX_PER_IMAGE and detector.labels[0] == "person"
    assert all(d.mask.shape == (240, 256) for d in found)


def test_a_checkpoint_of_another_layout_is_refused_in_one_line(checkpoint, tmp_path):
    state = seeded(KNOWN["keys"])
    with pytest.raises(UserError, match="no tensor 'panoptic_head.cls_embed.weight'"):
        convert_state_dict({k: v for k, v in state.items() if not k.startswith("panoptic_head.cls_embed")})
    with pytest.raises(UserError, match="1 tensors this conversion does not know .*'backbone.extra.weight'"):
        convert_state_dict({**state, "backbone.extra.weight": torch.zeros(1)})
    with pytest.raises(UserError, match="no such file"):
        convert_checkpoint(tmp_path / "missing.pth", tmp_path / "out")


def test_the_command_writes_the_folder_and_keeps_a_users_files(checkpoint, tmp_path, capsys):
    from flowalign.cli.main import main

    out = tmp_path / "detector"
    assert main(["geneval-detector", str(checkpoint), "--out", str(out)]) == 0
    assert {"config.json", "model.safetensors", "preprocessor_config.json"} <= {p.name for p in out.iterdir()}
    source = json.loads((out / "conversion.json").read_text())  # the weights the folder holds, by their file's hash
    assert source["sha256"] == hashlib.sha256(checkpoint.read_bytes()).hexdigest()
    assert "load with {name: geneval, path:" in capsys.readouterr().out
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    assert main(["geneval-detector", str(checkpoint), "--out", str(mine)]) == 2
    assert "holds files this command did not write (notes.txt)" in capsys.readouterr().err
    assert (mine / "notes.txt").read_text() == "mine" and not (mine / "config.json").exists()
