"""The detectors behind the ``geneval`` reward, each loaded with transformers from a local folder.

* :class:`Mask2FormerDetector`: ``Mask2FormerForUniversalSegmentation`` (the architecture GenEval evaluates
  with) over the 80 COCO classes. Its instance post-processing is mmdetection's, which GenEval ran: class
  probabilities of every (query, class) pair, the top 100, each scored ``class prob × mean mask prob`` inside
  its mask, masks at the original image size, boxes around the masks. (transformers' own
  ``post_process_instance_segmentation`` resizes to a fixed 384 px before cropping the padding, so it is not
  used.)
  The detector reads each image at GenEval's test scale (``resize: geneval``: its mmdetection config's, see
  :func:`genevals_scale`), or at the folder's image-processor size (``processor``: 384 × 384 for the released
  transformers download).
* :class:`Owlv2Detector`: ``Owlv2ForObjectDetection``, open-vocabulary, for classes outside COCO; boxes only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from rewards.geneval.rules import Detection
from rewards.geneval.vocabulary import CLASSES

#: detections kept per image before the rules' thresholds (mmdetection's ``max_per_image`` for Mask2Former)
MAX_PER_IMAGE = 100
#: GenEval's detector config (mmdetection's ``mask2former_swin-s-p4-w7-224_lsj_8x2_50e_coco.py``) tests at
#: ``img_scale (1333, 800)`` keeping the aspect ratio, then pads to a multiple of 32 with grey 128 before normalising
GENEVAL_SCALE = (1333, 800)
PAD_DIVISOR, PAD_VALUE = 32, 128
RESIZE = {"geneval": "GenEval's test scale: the shorter side to 800, the longer at most 1333, padded to 32 with grey",
          "processor": "the detector folder's image processor (384 x 384 for the released transformers download)"}


def genevals_scale(image: np.ndarray) -> tuple[np.ndarray, tuple[int, int]]:
    """``image`` uint8 ``(H, W, 3)`` as GenEval's detector config prepares it, before normalising: rescaled
    bilinearly by ``min(1333 / long side, 800 / short side)`` (sizes rounded half up, as mmcv's ``rescale_size``),
    then padded right and bottom to multiples of 32 with 128. Returns the padded uint8 ``(H', W', 3)`` and the
    rescaled ``(h, w)`` inside it."""
    h, w = image.shape[:2]
    scale = min(max(GENEVAL_SCALE) / max(h, w), min(GENEVAL_SCALE) / min(h, w))
    size = int(h * scale + 0.5), int(w * scale + 0.5)
    pixels = torch.from_numpy(np.ascontiguousarray(image)).permute(2, 0, 1)[None].float()
    # mmcv resizes with cv2's INTER_LINEAR: half-pixel bilinear without antialiasing, back to uint8
    pixels = F.interpolate(pixels, size=size, mode="bilinear", align_corners=False).round().clamp(0, 255)
    padded = [-(-n // PAD_DIVISOR) * PAD_DIVISOR for n in size]
    out = torch.full((3, *padded), float(PAD_VALUE))
    out[:, :size[0], :size[1]] = pixels[0]
    return out.to(torch.uint8).permute(1, 2, 0).numpy(), size


class FrozenDetector:
    """A detection model loaded frozen (eval mode, no gradients) as ``self.model``, with its processor."""

    model: torch.nn.Module

    @property
    def modules(self) -> list[torch.nn.Module]:
        """What the reward moves between devices."""
        return [self.model]


class Mask2FormerDetector(FrozenDetector):
    """A COCO instance-segmentation Mask2Former and its image processor from ``path``."""

    def __init__(self, path: Path, dtype: torch.dtype, random_init: bool = False, resize: str = "geneval"):
        from transformers import AutoImageProcessor, Mask2FormerConfig, Mask2FormerForUniversalSegmentation

        net = (Mask2FormerForUniversalSegmentation(Mask2FormerConfig.from_pretrained(path)) if random_init
               else Mask2FormerForUniversalSegmentation.from_pretrained(path))
        self.model = net.to(dtype).eval().requires_grad_(False)
        self.processor = AutoImageProcessor.from_pretrained(path)
        self.resize = resize
        id2label = self.model.config.id2label
        # an 80-class model is COCO's, in COCO's order: use GenEval's spelling of each class
        self.labels = list(CLASSES) if len(id2label) == len(CLASSES) else [id2label[i] for i in range(len(id2label))]

    @torch.no_grad()
    def __call__(self, images: Sequence[np.ndarray], min_score: float, queries: Sequence[Sequence[str]] | None = None
                 ) -> list[list[Detection]]:
        """``images`` uint8 ``(H, W, 3)`` → per image, its detections scoring above ``min_score``."""
        device, dtype = self.model.device, self.model.dtype
        if self.resize == "geneval":
            prepared = [genevals_scale(image) for image in images]
            inputs = self.processor(images=[padded for padded, _ in prepared], do_resize=False, return_tensors="pt")
            scaled = [size for _, size in prepared]
        else:
            inputs = self.processor(images=list(images), return_tensors="pt")
            scaled = [(int(m.any(1).sum()), int(m.any(0).sum())) for m in inputs["pixel_mask"]]
        pixel_values = inputs["pixel_values"].to(device, dtype)
        out = self.model(pixel_values=pixel_values, pixel_mask=inputs["pixel_mask"].to(device))
        return [self._instances(out.class_queries_logits[i].float(), out.masks_queries_logits[i].float(),
                                scaled[i], tuple(pixel_values.shape[-2:]), image.shape[:2], min_score)
                for i, image in enumerate(images)]

    def _instances(self, class_logits: torch.Tensor, mask_logits: torch.Tensor, scaled: tuple[int, int],
                   padded: tuple[int, int], size: tuple[int, int], min_score: float) -> list[Detection]:
        num_classes = class_logits.shape[-1] - 1
        probs = class_logits.softmax(-1)[:, :-1].flatten()
        top, index = probs.topk(min(MAX_PER_IMAGE, probs.numel()))
        queries, labels = index // num_classes, index % num_classes
        # only the queries among the top pairs are upsampled: padded input size, padding cropped (the rescaled
        # image inside it), original size
        distinct, row = torch.unique(queries, return_inverse=True)
        logits = F.interpolate(mask_logits[distinct][None], size=padded, mode="bilinear", align_corners=False)[0]
        h, w = scaled
        logits = F.interpolate(logits[None, :, :h, :w], size=size, mode="bilinear", align_corners=False)[0]
        binary = logits > 0
        mask_score = (logits.sigmoid() * binary).flatten(1).sum(1) / (binary.flatten(1).sum(1) + 1e-6)
        scores = top * mask_score[row]
        out = []
        for k in torch.nonzero(scores > min_score).flatten().tolist():
            mask = binary[row[k]]
            cols, rows = torch.nonzero(mask.any(0)).flatten(), torch.nonzero(mask.any(1)).flatten()
            if not len(cols):
                continue
            box = (float(cols[0]), float(rows[0]), float(cols[-1] + 1), float(rows[-1] + 1))
            out.append(Detection(self.labels[int(labels[k])], float(scores[k]), box, mask.cpu().numpy()))
        return out


class Owlv2Detector(FrozenDetector):
    """An OWLv2 open-vocabulary detector and its processor from ``path``; each image is queried with the
    classes its prompt names (``"a photo of a <class>"``, OWL-ViT's query form)."""

    def __init__(self, path: Path, dtype: torch.dtype, random_init: bool = False):
        from transformers import AutoProcessor, Owlv2Config, Owlv2ForObjectDetection

        net = (Owlv2ForObjectDetection(Owlv2Config.from_pretrained(path)) if random_init
               else Owlv2ForObjectDetection.from_pretrained(path))
        self.model = net.to(dtype).eval().requires_grad_(False)
        self.processor = AutoProcessor.from_pretrained(path)

    @torch.no_grad()
    def __call__(self, images: Sequence[np.ndarray], min_score: float, queries: Sequence[Sequence[str]] | None = None
                 ) -> list[list[Detection]]:
        assert queries is not None, "OWLv2 needs the classes to look for"
        device, dtype = self.model.device, self.model.dtype
        texts = [[f"a photo of a {c}" for c in q] for q in queries]
        inputs = self.processor(text=texts, images=list(images), return_tensors="pt")
        inputs = {k: (v.to(device, dtype) if v.is_floating_point() else v.to(device)) for k, v in inputs.items()}
        out = self.model(**inputs)
        # OWLv2 pads each image to a square (bottom and right): boxes are relative to that square
        sides = [(max(im.shape[:2]),) * 2 for im in images]
        results = self.processor.post_process_grounded_object_detection(out, threshold=min_score, target_sizes=sides)
        detections = []
        for image, names, res in zip(images, queries, results):
            h, w = image.shape[:2]
            dets = []
            for score, label, box in zip(res["scores"].tolist(), res["labels"].tolist(), res["boxes"].tolist()):
                if label < len(names):  # padded query slots of a shorter query list
                    x0, y0, x1, y1 = box
                    dets.append(Detection(names[label], float(score),
                                          (max(x0, 0.0), max(y0, 0.0), min(x1, float(w)), min(y1, float(h)))))
            detections.append(dets)
        return detections
