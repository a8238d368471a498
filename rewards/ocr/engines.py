"""OCR engines: each reads a list of PIL images and returns the text it recognises in each.

* ``rapidocr`` (the default): PaddleOCR's PP-OCRv4 detection and recognition models as ONNX, from the
  ``rapidocr_onnxruntime`` wheel (a core dependency: nothing to download, no system program), run on the
  CPU by :mod:`rewards.ocr.ppocr`.
* ``tesseract``: the Tesseract program through ``pytesseract`` (CPU; ``apt-get install tesseract-ocr``,
  ``pip install 'flowalign[ocr]'``).
* ``got_ocr2``: GOT-OCR 2.0 through transformers (``GotOcr2ForConditionalGeneration``) from a local
  folder (``stepfun-ai/GOT-OCR-2.0-hf``); for GPUs.
* ``paddleocr``: PaddleOCR, the engine Flow-GRPO trains and reports with (an optional install), from
  local detection and recognition model folders.

An engine raises on an image it cannot read; the reward then marks that sample invalid.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from PIL import Image

from flowalign.errors import UserError

#: tokens GOT-OCR 2.0 may generate per image: the prompts' texts are a few words, a scene may hold more
GOT_MAX_NEW_TOKENS = 128
GOT_WEIGHTS = "the GOT-OCR 2.0 transformers folder (stepfun-ai/GOT-OCR-2.0-hf)"
PADDLE_WEIGHTS = ("a folder with PaddleOCR's English inference models as det/ and rec/ "
                  "(PaddleOCR 2.x: en_PP-OCRv3_det_infer, en_PP-OCRv4_rec_infer)")


class Engine(Protocol):
    def read(self, images: list[Image.Image], device: torch.device) -> list[str]:
        """The text recognised in each image; ``device``: where the samples are (model engines run there
        unless the reward's ``device`` option says otherwise)."""
        ...


def local_folder(path: str | None, engine: str, what: str) -> Path:
    """``path`` as an existing local folder, else one line naming the reward, the option and the download."""
    if not path:
        raise UserError(f"ocr reward: engine {engine} needs path: set it to {what}")
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise UserError(f"ocr reward: path={path} is not a folder; engine {engine} needs {what}")
    return folder


class RapidOCR:
    """PP-OCRv4 (the model family of Flow-GRPO's PaddleOCR engine) on the CPU: each image's lines, joined
    with line breaks (all lines, whatever their confidence, as Flow-GRPO keeps them)."""

    def __init__(self):
        from rewards.ocr.ppocr import DET_MODEL, REC_MODEL, PPOCR, models_folder

        folder = models_folder()
        if folder is None or not (folder / DET_MODEL).is_file() or not (folder / REC_MODEL).is_file():
            raise UserError("ocr reward: engine rapidocr needs the rapidocr_onnxruntime package, which carries its "
                            "PP-OCRv4 models (pip install 'rapidocr_onnxruntime>=1.4,<2'), or choose engine: tesseract")
        try:
            import onnxruntime  # noqa: F401 - checked here for a one-line error, used by PPOCR
        except ImportError:
            raise UserError("ocr reward: engine rapidocr needs onnxruntime (pip install onnxruntime)") from None
        # as many threads as torch was given: the tests and a trainer's reward calls share the machine
        self.ocr = PPOCR(folder, threads=max(1, torch.get_num_threads()))

    def read(self, images: list[Image.Image], device: torch.device) -> list[str]:
        return ["\n".join(text for text, _confidence in self.ocr.read(image)) for image in images]


class Tesseract:
    """Tesseract on each image; ``config`` is passed to the program (page segmentation 11, sparse text,
    finds words anywhere in a scene rather than expecting a page)."""

    def __init__(self, config: str = "--psm 11"):
        try:
            import pytesseract
        except ImportError:
            raise UserError("ocr reward: engine tesseract needs pytesseract (pip install 'flowalign[ocr]')") from None
        try:
            pytesseract.get_tesseract_version()
        except pytesseract.TesseractNotFoundError:
            raise UserError("ocr reward: engine tesseract needs the tesseract program "
                            "(apt-get install tesseract-ocr, or brew install tesseract)") from None
        self.pytesseract, self.config = pytesseract, config

    def read(self, images: list[Image.Image], device: torch.device) -> list[str]:
        return [self.pytesseract.image_to_string(image, lang="eng", config=self.config) for image in images]


class GotOcr2:
    """GOT-OCR 2.0 (plain-text OCR of the whole image, greedy decoding)."""

    def __init__(self, path: str | None, device: torch.device | None, dtype: torch.dtype):
        folder = local_folder(path, "got_ocr2", GOT_WEIGHTS)
        from transformers import AutoProcessor, GotOcr2ForConditionalGeneration

        try:
            self.processor = AutoProcessor.from_pretrained(folder)
            self.model = GotOcr2ForConditionalGeneration.from_pretrained(folder, dtype=dtype).eval()
        except (OSError, ValueError) as e:
            raise UserError(f"ocr reward: could not load path={path} for engine got_ocr2 ({e}); "
                            f"give {GOT_WEIGHTS}") from None
        self.device, self.dtype = device, dtype

    @torch.no_grad()
    def read(self, images: list[Image.Image], device: torch.device) -> list[str]:
        device = self.device or device
        self.model.to(device)
        inputs = self.processor(images, return_tensors="pt").to(device)
        inputs["pixel_values"] = inputs["pixel_values"].to(self.dtype)
        ids = self.model.generate(**inputs, do_sample=False, tokenizer=self.processor.tokenizer,
                                  stop_strings="<|im_end|>", max_new_tokens=GOT_MAX_NEW_TOKENS)
        return self.processor.batch_decode(ids[:, inputs["input_ids"].shape[1]:], skip_special_tokens=True)


class PaddleOCR:
    """PaddleOCR 2.x as Flow-GRPO calls it (English, no angle classifier; lines with a confidence above 0,
    joined), with its models read from ``path``/det and ``path``/rec."""

    def __init__(self, path: str | None, device: torch.device | None):
        folder = local_folder(path, "paddleocr", PADDLE_WEIGHTS)
        for sub in ("det", "rec"):
            if not (folder / sub).is_dir():
                raise UserError(f"ocr reward: path={path} has no {sub}/ folder; engine paddleocr needs {PADDLE_WEIGHTS}")
        try:
            from paddleocr import PaddleOCR as Paddle
        except ImportError:
            raise UserError("ocr reward: engine paddleocr needs the paddleocr package "
                            "2.x (pip install paddleocr==2.9.1 paddlepaddle, as Flow-GRPO), or use engine: rapidocr") from None
        use_gpu = device is not None and torch.device(device).type == "cuda"
        self.ocr = Paddle(use_angle_cls=False, lang="en", use_gpu=use_gpu, show_log=False,
                          det_model_dir=str(folder / "det"), rec_model_dir=str(folder / "rec"))

    def read(self, images: list[Image.Image], device: torch.device) -> list[str]:
        texts = []
        for image in images:
            lines: Any = self.ocr.ocr(np.asarray(image), cls=False)[0] or []
            texts.append("".join(text for _box, (text, confidence) in lines if confidence > 0))
        return texts


ENGINES = ("rapidocr", "tesseract", "got_ocr2", "paddleocr")


def make_engine(engine: str, path: str | None, device: torch.device | None, dtype: torch.dtype) -> Engine:
    """The engine named ``engine`` (one of :data:`ENGINES`)."""
    if engine == "rapidocr":
        return RapidOCR()
    if engine == "tesseract":
        return Tesseract()
    if engine == "got_ocr2":
        return GotOcr2(path, device, dtype)
    if engine == "paddleocr":
        return PaddleOCR(path, device)
    raise UserError(f"ocr reward: unknown engine={engine!r}; choose one of {', '.join(ENGINES)}")
