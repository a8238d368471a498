"""A random, architecture-faithful ``geneval`` folder pair for offline tests of the real loaders.

``save_tiny_geneval(out)`` writes ``out/detector`` (a ``Mask2FormerForUniversalSegmentation`` with a
tiny four-stage Swin backbone, 80 COCO labels, and its ``Mask2FormerImageProcessor``) and ``out/clip`` (a
``CLIPModel`` with a CLIP tokenizer and image processor), each with ``save_pretrained``: what
``rewards.load("geneval", path=out/"detector", clip_path=out/"clip")`` reads from the real downloads.
"""

from __future__ import annotations

from pathlib import Path

import torch

from rewards.geneval.vocabulary import CLASSES
from rewards.tiny_towers import clip_style_towers


def save_tiny_geneval(out: Path, seed: int = 0, *, overwrite: bool = False) -> dict[str, Path]:
    """Write the tiny detector and CLIP under ``out``; returns ``{"path": ..., "clip_path": ...}``. Written
    atomically as one folder (:func:`flowalign.io.atomic_dir`, writer ``save-tiny-geneval``): a failure leaves
    ``out`` as it was, and a folder holding files it did not write is refused unless ``overwrite``."""
    from transformers import (
        CLIPConfig,
        CLIPImageProcessor,
        CLIPModel,
        CLIPProcessor,
        Mask2FormerConfig,
        Mask2FormerForUniversalSegmentation,
        Mask2FormerImageProcessor,
        SwinConfig,
    )

    from flowalign.io import atomic_dir
    from pipelines.tiny import clip_tokenizer

    out = Path(out)
    backbone = SwinConfig(image_size=64, patch_size=4, embed_dim=8, depths=[1, 1, 1, 1], num_heads=[1, 1, 1, 1],
                          window_size=4, out_features=["stage1", "stage2", "stage3", "stage4"])
    config = Mask2FormerConfig(
        backbone_config=backbone, feature_size=32, mask_feature_size=32, hidden_dim=32, encoder_feedforward_dim=32,
        dim_feedforward=32, encoder_layers=1, decoder_layers=2, num_attention_heads=2, num_queries=10, num_labels=len(CLASSES),
        id2label=dict(enumerate(CLASSES)), label2id={c: i for i, c in enumerate(CLASSES)})
    tok = clip_tokenizer(vocab_size=1024, model_max_length=32)
    text, vision = clip_style_towers(tok, layers=1, max_positions=32, image_size=32)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        detector = Mask2FormerForUniversalSegmentation(config).eval()
        clip = CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=16)).eval()
    with atomic_dir(out, writer="save-tiny-geneval", overwrite=overwrite) as tmp:
        detector.save_pretrained(tmp / "detector")
        Mask2FormerImageProcessor(size={"shortest_edge": 64, "longest_edge": 128}, size_divisor=32,
                                  ignore_index=255).save_pretrained(tmp / "detector")
        clip.save_pretrained(tmp / "clip")
        image_processor = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
        CLIPProcessor(image_processor=image_processor, tokenizer=tok).save_pretrained(tmp / "clip")
    return {"path": out / "detector", "clip_path": out / "clip"}


def save_tiny_owlv2(out: Path, seed: int = 0, *, overwrite: bool = False) -> Path:
    """A random tiny ``Owlv2ForObjectDetection`` and its processor in ``out`` (for ``detector: owlv2``), written
    atomically (writer ``save-tiny-owlv2``; a folder of other files refused unless ``overwrite``)."""
    from transformers import (
        Owlv2Config,
        Owlv2ForObjectDetection,
        Owlv2ImageProcessor,
        Owlv2Processor,
    )

    from flowalign.io import atomic_dir
    from pipelines.tiny import clip_tokenizer

    tok = clip_tokenizer(vocab_size=1024, model_max_length=16)
    text, vision = clip_style_towers(tok, layers=1, max_positions=16, image_size=64)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Owlv2ForObjectDetection(Owlv2Config(text_config=text, vision_config=vision, projection_dim=32)).eval()
    out = Path(out)
    with atomic_dir(out, writer="save-tiny-owlv2", overwrite=overwrite) as tmp:
        model.save_pretrained(tmp)
        Owlv2Processor(image_processor=Owlv2ImageProcessor(size={"height": 64, "width": 64}),
                       tokenizer=tok).save_pretrained(tmp)
    return out
