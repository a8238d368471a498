"""The ``ocr`` reward: how well an image renders the text its prompt quotes (Flow-GRPO's OCR reward)."""

from __future__ import annotations

from typing import Any

import torch
from PIL import Image

from flowalign.errors import UserError
from flowalign.protocols import NotSized, RewardOutput
from rewards.common import check_images, check_lengths, finite_mask, resolve_dtype, to_pil
from rewards.ocr.engines import make_engine
from rewards.ocr.score import ocr_score, target_text
from rewards.planning import existing, missing, on_accelerator, option, transformers_bytes
from rewards.registry import register


@register("ocr")
class OCRReward:
    """Score ``1`` when the prompt's quoted text (``metadata["text"]`` if given) appears in the text an OCR
    engine reads from the image, else ``1 - min(edit distance, n) / n`` (lower case, spaces removed;
    :mod:`rewards.ocr.score`). Options: ``engine`` (``rapidocr``, the default: PP-OCRv4 from a pip wheel on
    the CPU; ``tesseract``, ``got_ocr2`` or ``paddleocr``), ``path`` (``got_ocr2``'s and ``paddleocr``'s
    local weights), ``device`` (default: the samples'), ``dtype`` and ``batch_size``
    (images per engine call). A sample is invalid, with a reason in its info, when its prompt quotes no
    text, its pixels are not finite or the engine fails on it. Not differentiable.
    """

    name = "ocr"
    differentiable = False

    def __init__(self, engine: str = "rapidocr", path: str | None = None, device: str | None = None,
                 dtype: str = "float32", batch_size: int = 8):
        if not isinstance(batch_size, int) or batch_size < 1:
            raise UserError(f"ocr reward: batch_size must be a positive integer, got {batch_size!r}")
        if engine in ("rapidocr", "tesseract") and path is not None:
            uses = {"rapidocr": "the PP-OCRv4 models in the rapidocr_onnxruntime package",
                    "tesseract": "the installed tesseract program"}[engine]
            raise UserError(f"ocr reward: engine {engine} takes no path (it uses {uses}); "
                            "remove path or choose engine: got_ocr2 or paddleocr")
        self.batch_size = batch_size
        self.device = torch.device(device) if device is not None else None
        self.engine = make_engine(engine, path, self.device, resolve_dtype(dtype, self.name))

    @classmethod
    def planned_bytes(cls, options: dict[str, Any]) -> int:
        """What the engine holds on the accelerator: nothing for ``rapidocr`` and ``tesseract`` (CPU programs) or
        for ``paddleocr`` without a CUDA ``device`` (it runs on the CPU then); ``got_ocr2``'s model in ``dtype``,
        from its folder's config on the meta device. PaddleOCR on the GPU is Paddle's own allocator, not sized."""
        from transformers import GotOcr2ForConditionalGeneration

        engine, device = option(cls, options, "engine"), option(cls, options, "device")
        if engine in ("rapidocr", "tesseract") or not on_accelerator(device):
            return 0
        if engine == "paddleocr":
            if device is None:
                return 0
            raise NotSized("engine paddleocr on a GPU holds Paddle's models, which are not sized")
        folder = existing(options.get("path"))
        if folder is None:
            raise missing("path", options.get("path"))
        dtype = resolve_dtype(option(cls, options, "dtype"), cls.name)
        return transformers_bytes(folder, GotOcr2ForConditionalGeneration, dtype)

    def _read(self, images: list[Image.Image], device: torch.device) -> list[str | Exception]:
        """The engine's text for each image, or the exception it raised on that image alone."""
        try:
            return list(self.engine.read(images, device))
        except Exception as e:  # noqa: BLE001 - that sample is invalid; in a batch, find which images fail
            if len(images) == 1:
                return [e]
        return [self._read([image], device)[0] for image in images]

    def __call__(self, samples: torch.Tensor, prompts: list[str], metadata: list[dict[str, Any]]) -> RewardOutput:
        """``samples`` ``(B, 3, H, W)`` float in [0, 1] → ``{"ocr": (B,)}``, ``valid`` and per-sample info
        (``target``, ``recognised``, ``all_passed``: the target was read exactly, ``reason`` when invalid)."""
        check_images(samples, self.name)
        check_lengths(samples.shape[0], prompts, metadata, self.name)
        n = samples.shape[0]
        finite = finite_mask(samples).tolist()
        targets = [target_text(p, metadata[i] if metadata else None) for i, p in enumerate(prompts)]
        infos: list[dict[str, Any]] = [{"target": t, "all_passed": False} for t in targets]
        for i in range(n):
            if not targets[i] or not targets[i].strip():
                infos[i]["reason"] = "the prompt quotes no text to render (and its metadata has no 'text')"
            elif not finite[i]:
                infos[i]["reason"] = "non-finite pixels"
        todo = [i for i in range(n) if "reason" not in infos[i]]
        device = self.device or samples.device
        for start in range(0, len(todo), self.batch_size):
            chunk = todo[start : start + self.batch_size]
            for i, text in zip(chunk, self._read([to_pil(samples[i]) for i in chunk], device)):
                if isinstance(text, Exception):
                    infos[i]["reason"] = f"the OCR engine failed: {type(text).__name__}: {text}"[:300]
                else:
                    infos[i]["recognised"] = " ".join(text.split())  # one line for logs and galleries
        scores = torch.zeros(n, dtype=torch.float32)
        for i, info in enumerate(infos):
            if "recognised" in info:
                scores[i] = ocr_score(info["recognised"], info["target"])
                info["all_passed"] = bool(scores[i] == 1.0)
        valid = torch.tensor(["reason" not in info for info in infos], dtype=torch.bool)
        return RewardOutput({self.name: scores.to(samples.device)}, valid=valid.to(samples.device), info=infos)
