"""Colour by CLIP zero-shot on each object's masked crop, as GenEval names colours.

Each object is pasted on a grey (#999) canvas through its mask (a box-only detection keeps its
surroundings), cropped to its box, and classified among GenEval's ten colours by a per-class zero-shot
head: the normalised mean of the text embeddings of "a photo of a {colour} {class}", "a photo of a
{colour}-colored {class}" and "a photo of a {colour} object" (clip_benchmark's zero-shot classifier, which
GenEval calls). The CLIP is a transformers ``CLIPModel`` folder (GenEval's is OpenAI's ViT-L/14).

The crops become CLIP's input as GenEval's own transform makes them (``preprocess: open_clip``, the default):
open_clip's evaluation transform, which GenEval and Flow-GRPO's reward server build with the model (the 8-bit
crop resized by PIL's bicubic filter so its short side is the input size, the centre crop placed by rounding
half the margin, as torchvision does). transformers' ``CLIPImageProcessor`` (``preprocess: processor``, the
former form) resizes a float copy and floors half the margin: up to one 8-bit level apart, and a pixel off
where the margin leaves half a pixel to round.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch
from PIL import Image

from rewards.geneval.rules import Detection
from rewards.geneval.vocabulary import COLOURS

BACKGROUND = (153, 153, 153)  # GenEval's "#999"
TEMPLATES = ("a photo of a {c} {cls}", "a photo of a {c}-colored {cls}", "a photo of a {c} object")
#: how a crop becomes CLIP's pixels: GenEval's open_clip transform, or transformers' processor (the former form)
PREPROCESS = {"open_clip": "GenEval's open_clip transform", "processor": "transformers' CLIPImageProcessor"}


def open_clip_transform(image_processor) -> Callable[[Image.Image], torch.Tensor]:
    """open_clip's evaluation transform at the processor's input size, mean and std: a PIL image →
    ``(3, S, S)`` float32 (what GenEval's ``ImageCrops`` hands its CLIP)."""
    from open_clip.transform import image_transform

    crop = image_processor.crop_size
    size = crop if isinstance(crop, int) else crop["height"]  # a dict or transformers' SizeDict
    return image_transform(size, is_train=False, mean=tuple(image_processor.image_mean),
                           std=tuple(image_processor.image_std), resize_mode="shortest", interpolation="bicubic")


def crop_pixels(crops: Sequence[Image.Image], processor, preprocess: str,
                transform: Callable[[Image.Image], torch.Tensor] | None = None) -> torch.Tensor:
    """``(N, 3, S, S)`` CLIP input of the RGB ``crops``, by ``preprocess`` (see the module docstring); ``transform``:
    the processor's :func:`open_clip_transform`, when built already."""
    if preprocess == "open_clip":
        transform = transform or open_clip_transform(processor.image_processor)
        return torch.stack([transform(crop) for crop in crops])
    return processor(images=list(crops), return_tensors="pt")["pixel_values"]


class ClipColours:
    def __init__(self, path: Path, dtype: torch.dtype, random_init: bool = False, preprocess: str = "open_clip"):
        from transformers import AutoProcessor, CLIPConfig, CLIPModel

        net = CLIPModel(CLIPConfig.from_pretrained(path)) if random_init else CLIPModel.from_pretrained(path)
        self.model = net.to(dtype).eval().requires_grad_(False)
        self.processor = AutoProcessor.from_pretrained(path)
        self.preprocess = preprocess
        self._heads: dict[str, torch.Tensor] = {}

    @property
    def modules(self) -> list[torch.nn.Module]:
        return [self.model]

    def _head(self, cls: str) -> torch.Tensor:
        """``(10, D)`` unit rows: one zero-shot class embedding per colour, for objects of ``cls``."""
        head = self._heads.get(cls)
        if head is None or head.device != self.model.device:
            texts = [t.format(c=c, cls=cls) for c in COLOURS for t in TEMPLATES]
            tokens = self.processor(text=texts, return_tensors="pt", padding=True).to(self.model.device)
            emb = self.model.get_text_features(**tokens).pooler_output.float()
            emb = torch.nn.functional.normalize(emb, dim=-1).view(len(COLOURS), len(TEMPLATES), -1).mean(1)
            head = self._heads[cls] = torch.nn.functional.normalize(emb, dim=-1)
        return head

    @torch.no_grad()
    def __call__(self, image: np.ndarray, cls: str, detections: Sequence[Detection]) -> list[str]:
        """The colour name of each detection of class ``cls`` in the uint8 ``(H, W, 3)`` ``image``."""
        if not detections:
            return []
        picture = Image.fromarray(image)
        canvas = Image.new("RGB", picture.size, BACKGROUND)
        crops = []
        for det in detections:
            shown = picture if det.mask is None else Image.composite(picture, canvas, Image.fromarray(det.mask))
            x0, y0, x1, y1 = (round(v) for v in det.box)
            crops.append(shown.crop((x0, y0, max(x1, x0 + 1), max(y1, y0 + 1))))  # a degenerate box: one pixel
        if self.preprocess == "open_clip" and getattr(self, "_transform", None) is None:
            self._transform = open_clip_transform(self.processor.image_processor)  # built once, not per call
        pixels = crop_pixels(crops, self.processor, self.preprocess, getattr(self, "_transform", None))
        feats = self.model.get_image_features(pixel_values=pixels.to(self.model.device, self.model.dtype)).pooler_output
        logits = torch.nn.functional.normalize(feats.float(), dim=-1) @ self._head(cls).T
        return [COLOURS[i] for i in logits.argmax(-1).tolist()]

