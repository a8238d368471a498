"""The registered ``geneval`` reward: detect, name colours, apply GenEval's rules (``rewards.geneval.rules``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, Mapping

import numpy as np
import torch

from flowalign.errors import UserError
from flowalign.protocols import RewardOutput
from rewards.common import check_images, check_jpeg_quality, check_lengths, finite_mask, jpeg_round_trip, resolve_dtype
from rewards.geneval import rules
from rewards.geneval.colour import PREPROCESS
from rewards.geneval.detector import RESIZE
from rewards.geneval.vocabulary import COLOURS, POSITIONS, TAGS
from rewards.model_options import one_of
from rewards.planning import existing, missing, on_accelerator, option, published, transformers_bytes
from rewards.registry import register

DETECTORS = {
    # detector → (weights to download, its defaults for threshold / counting_threshold / nms_threshold)
    "mask2former": ("facebook/mask2former-swin-small-coco-instance",
                    (rules.THRESHOLD, rules.COUNTING_THRESHOLD, rules.NMS_THRESHOLD)),
    # [derived] OWLv2 scores are sigmoid box-text matches, lower than Mask2Former's class probabilities, and its
    # boxes overlap for one object: OWL-ViT's usual 0.1 threshold, 0.3 for counts, NMS at IoU 0.5
    "owlv2": ("google/owlv2-base-patch16-ensemble", (0.1, 0.3, 0.5)),
}
CHANNELS = {
    "reversed": "the detector reads blue, green, red: Flow-GRPO's reward server hands mmdetection RGB arrays, "
                "which its loader takes for BGR",
    "rgb": "the detector reads the sample's channels in order, as GenEval's evaluator loads its files",
}
#: each detector's channel order and input size when detector_channels / detector_size is not given: Mask2Former's
#: are Flow-GRPO's reward server's (GenEval's config); OWLv2 never ran behind that server, and reads its own size
DETECTOR_CHANNELS = {"mask2former": "reversed", "owlv2": "rgb"}
DETECTOR_SIZE = {"mask2former": "geneval", "owlv2": "processor"}
CLIP_WEIGHTS = "openai/clip-vit-large-patch14"
#: the architectures of those downloads that ship (assets/reward_architectures/), what a folder not there yet is sized as
PUBLISHED = {"mask2former": "mask2former-swin-small-coco-instance", "clip": "clip-vit-large-patch14"}
SCORES = ("partial", "strict")


@register("geneval")
class GenEvalReward:
    """GenEval-style compositional reward; ``metadata[i]`` is a GenEval metadata line (``tag``, ``include``,
    ``exclude``). The component ``geneval`` is ``score``: ``partial`` (the share of requirements met, what
    Flow-GRPO trains on; default) or ``strict`` (1 when GenEval's verdict is correct, else 0); both are in
    each sample's ``info`` with ``all_passed`` (GenEval's verdict, the benchmark accuracy), ``exact`` (the
    reward server's exact-count verdict, Flow-GRPO's logged ``strict_accuracy``) and its ``tag``."""

    name = "geneval"
    differentiable = False
    requires_metadata = ("tag", "include")
    #: what runs saved before these options existed computed: the decoded pixels, uncompressed; the colour
    #: crops through transformers' CLIP processor; the detector reading the channels in order, at its processor's size
    before: ClassVar[dict[str, Any]] = {"jpeg_quality": None, "colour_preprocess": "processor",
                                        "detector_channels": "rgb", "detector_size": "processor"}

    def __init__(self, path: str | None = None, clip_path: str | None = None, detector: str = "mask2former",
                 score: str = "partial", device: str | None = None, dtype: str = "float32", batch_size: int = 16,
                 threshold: float | None = None, counting_threshold: float | None = None,
                 nms_threshold: float | None = None, max_objects: int = rules.MAX_OBJECTS,
                 position_threshold: float = rules.POSITION_THRESHOLD, random_init: bool = False,
                 jpeg_quality: int | None = 75, colour_preprocess: str = "open_clip",
                 detector_channels: str | None = None, detector_size: str | None = None):
        one_of("geneval reward", "detector", detector, DETECTORS)
        #: None: the detector's own (DETECTOR_CHANNELS), so a recorded null resolves the same way again
        self.detector_channels = DETECTOR_CHANNELS[detector] if detector_channels is None else detector_channels
        one_of("geneval reward", "detector_channels", self.detector_channels, CHANNELS, CHANNELS)
        self.detector_size = DETECTOR_SIZE[detector] if detector_size is None else detector_size
        one_of("geneval reward", "detector_size", self.detector_size, RESIZE, RESIZE)
        if detector == "owlv2" and self.detector_size != "processor":
            raise UserError("geneval reward: detector_size=geneval is GenEval's Mask2Former test scale; OWLv2 reads "
                            "its processor's size: leave detector_size out or give processor")
        one_of("geneval reward", "colour_preprocess", colour_preprocess, PREPROCESS, PREPROCESS)
        one_of("geneval reward", "score", score, SCORES)
        check_jpeg_quality(jpeg_quality, self.name)
        #: Flow-GRPO's geneval_score sends each sample to its reward server as a JPEG at PIL's default quality
        #: (75), so the detector it trains against reads compressed pixels; null scores the decoded pixels, as
        #: GenEval's evaluator reads the PNG files it is given (the benchmark's setting)
        self.jpeg_quality = jpeg_quality
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise UserError(f"geneval reward: batch_size must be a positive integer, got {batch_size!r}")
        weights, (th, count_th, nms) = DETECTORS[detector]
        self.threshold = th if threshold is None else threshold
        self.counting_threshold = count_th if counting_threshold is None else counting_threshold
        self.nms_threshold = nms if nms_threshold is None else nms_threshold
        self.max_objects, self.position_threshold = max_objects, position_threshold
        self.score, self.batch_size = score, batch_size
        self.device = torch.device(device) if device is not None else None
        torch_dtype = resolve_dtype(dtype, self.name)
        detector_dir = _folder(path, "path", f"the {detector} detector (e.g. a download of {weights})")
        clip_dir = _folder(clip_path, "clip_path", f"a transformers CLIP for colours (GenEval's: {CLIP_WEIGHTS})")
        from rewards.geneval.colour import ClipColours
        from rewards.geneval.detector import Mask2FormerDetector, Owlv2Detector

        self.detector = (Mask2FormerDetector(detector_dir, torch_dtype, random_init, self.detector_size)
                         if detector == "mask2former" else Owlv2Detector(detector_dir, torch_dtype, random_init))
        self.colours = ClipColours(clip_dir, torch_dtype, random_init, colour_preprocess)
        #: classes the detector can name (None: open vocabulary)
        self.classes = set(self.detector.labels) if detector == "mask2former" else None

    @classmethod
    def planned_bytes(cls, options: dict[str, Any]) -> int:
        """Bytes of the detector and the colour CLIP in ``dtype``, from their folders' configs on the meta device;
        0 with ``device: cpu``. A folder that does not exist is sized as the model GenEval scores with, where its
        config ships (``assets/reward_architectures/``: Mask2Former Swin-S COCO, CLIP ViT-L/14)."""
        from transformers import CLIPModel, Mask2FormerForUniversalSegmentation, Owlv2ForObjectDetection

        if not on_accelerator(option(cls, options, "device")):
            return 0
        dtype = resolve_dtype(option(cls, options, "dtype"), cls.name)
        detector = option(cls, options, "detector")
        detector_class = Mask2FormerForUniversalSegmentation if detector == "mask2former" else Owlv2ForObjectDetection
        total = 0
        for name, model_class, release in (("path", detector_class, PUBLISHED.get(detector)),
                                           ("clip_path", CLIPModel, PUBLISHED["clip"])):
            folder = existing(options.get(name))
            if folder is None and release is None:
                raise missing(name, options.get(name))
            total += transformers_bytes(folder or published(release), model_class, dtype)
        return total

    def __call__(self, samples: torch.Tensor, prompts: list[str], metadata: list[dict[str, Any]]) -> RewardOutput:
        """``samples`` ``(B, 3, H, W)`` in [0, 1] → ``{"geneval": (B,)}``; a non-finite sample is invalid."""
        check_images(samples, self.name)
        check_lengths(samples.shape[0], prompts, metadata, self.name)
        n = samples.shape[0]
        if len(metadata) != n:
            raise UserError(f"geneval reward: got {n} samples but no GenEval metadata; give each prompt its "
                            "tag/include (a GenEval metadata .jsonl, or data.bench: geneval)")
        for i, meta in enumerate(metadata):
            check_metadata(meta, self.classes, f"prompt {i} ({prompts[i][:40]!r})")
        device = self.device or samples.device
        for module in self.detector.modules + self.colours.modules:
            module.to(device)
        valid = finite_mask(samples).cpu()
        pixels = (samples.detach().float().nan_to_num(0.0).clamp(0, 1) * 255).round().to(torch.uint8)
        pixels = pixels.permute(0, 2, 3, 1).cpu().numpy()
        if self.jpeg_quality is not None:
            from PIL import Image

            pixels = np.stack([np.asarray(jpeg_round_trip(Image.fromarray(p), self.jpeg_quality)) for p in pixels])
        min_score = min(self.threshold, self.counting_threshold)
        # only the detector reads reversed channels: the server's colour crops come from the PIL image, in order
        seen = np.ascontiguousarray(pixels[..., ::-1]) if self.detector_channels == "reversed" else pixels
        detections: list[list[rules.Detection]] = []
        for start in range(0, n, self.batch_size):
            chunk = slice(start, start + self.batch_size)
            queries = [_classes_named(m) for m in metadata[chunk]]
            detections += self.detector(list(seen[chunk]), min_score, queries)
        scores = torch.zeros(n, dtype=torch.float32)
        info = []
        for i in range(n):
            if not valid[i]:  # a non-finite sample is masked, never judged
                info.append({"tag": metadata[i]["tag"], "all_passed": False, "reason": "non-finite sample"})
                continue
            verdict = self._judge(pixels[i], detections[i], metadata[i])
            scores[i] = verdict.partial if self.score == "partial" else float(verdict.correct)
            info.append({"tag": metadata[i]["tag"], "all_passed": verdict.correct, "strict": float(verdict.correct),
                         "partial": verdict.partial, "exact": verdict.exact, "constraints": verdict.checks,
                         "reason": "; ".join(verdict.reasons)})
        return RewardOutput({self.name: scores.to(samples.device)}, valid=valid.to(samples.device), info=info)

    def _judge(self, image: np.ndarray, detections: list[rules.Detection], meta: Mapping[str, Any]) -> rules.Verdict:
        objects = rules.select_objects(detections, meta["tag"], threshold=self.threshold,
                                       counting_threshold=self.counting_threshold, max_objects=self.max_objects,
                                       nms_threshold=self.nms_threshold)
        named: dict[int, str] = {}  # both verdicts ask about the same objects: classify each once

        def colours(cls: str, dets: list[rules.Detection]) -> list[str]:
            todo = [d for d in dets if id(d) not in named]
            named.update(zip(map(id, todo), self.colours(image, cls, todo)))
            return [named[id(d)] for d in dets]

        return rules.judge(objects, meta, colours, position_threshold=self.position_threshold)


def _folder(path: str | None, option: str, what: str) -> Path:
    """``path`` as an existing folder, else one line naming the option and what to download."""
    if path is None:
        raise UserError(f"geneval reward: {option} is not set; download {what} and give {option}: <folder>")
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise UserError(f"geneval reward: {option}={path!r} is not a folder; download {what} there")
    return folder


def _classes_named(meta: Mapping[str, Any]) -> list[str]:
    return list(dict.fromkeys(r["class"] for r in [*meta.get("include", []), *meta.get("exclude", [])]))


def check_metadata(meta: Any, classes: set[str] | None, where: str) -> None:
    """Refuse a malformed GenEval metadata line with one line naming the field."""
    def bad(msg: str) -> UserError:
        return UserError(f"geneval reward: {where}: {msg}")

    if not isinstance(meta, Mapping) or meta.get("tag") not in TAGS:
        raise bad(f"'tag' must be one of {', '.join(TAGS)}, got {meta.get('tag') if isinstance(meta, Mapping) else meta!r}")
    clauses = meta.get("include")
    if not isinstance(clauses, list) or not clauses:
        raise bad("'include' must be a non-empty list of {class, count, color?, position?}")
    for key in ("include", "exclude"):
        for j, req in enumerate(meta.get(key) or []):
            if not isinstance(req, Mapping) or not isinstance(req.get("class"), str):
                raise bad(f"{key}[{j}] needs a 'class' name")
            count = req.get("count")
            if not isinstance(count, int) or isinstance(count, bool) or count < 1:
                raise bad(f"{key}[{j}].count must be a positive integer, got {count!r}")
            if classes is not None and req["class"] not in classes:
                raise bad(f"{key}[{j}].class {req['class']!r} is not a class of the detector; use a COCO class "
                          "as GenEval names it, or detector: owlv2 for other objects")
            if "color" in req and req["color"] not in COLOURS:
                raise bad(f"{key}[{j}].color must be one of {', '.join(COLOURS)}, got {req['color']!r}")
            if "position" in req:
                pos = req["position"]
                if (not isinstance(pos, (list, tuple)) or len(pos) != 2 or pos[0] not in POSITIONS
                        or not isinstance(pos[1], int) or not 0 <= pos[1] < j):
                    raise bad(f"{key}[{j}].position must be [relation, index of an earlier include], relation one "
                              f"of {', '.join(POSITIONS)}; got {pos!r}")
