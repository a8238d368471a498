"""Image data on disk for trainers that learn from images: (image, caption) pairs and preference triples.

Formats (paths inside a JSONL file are relative to the file's folder):

- caption pairs, a folder: ``name.png`` (``.jpg``, ``.jpeg``, ``.webp``) beside ``name.txt`` holding the
  caption; or a JSONL file, one ``{"image": PATH, "prompt": TEXT}`` a line (``caption`` / ``text`` also read).
- preference triples, a JSONL file: one ``{"prompt": TEXT, "chosen": PATH, "rejected": PATH}`` a line.

Every file is checked when the set is read, so a missing image is an error before any training compute.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from flowalign.data import PromptSet
from flowalign.errors import UserError

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp")
CAPTION_KEYS = ("prompt", "caption", "text")


def _read_jsonl(path: Path, field: str) -> list[dict[str, Any]]:
    rows = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{field}: {path}:{i} is not valid JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise UserError(f"{field}: {path}:{i} must be a JSON object")
        rows.append(row)
    if not rows:
        raise UserError(f"{field}: {path} holds no rows")
    return rows


def _resolve(base: Path, value: Any, field: str, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise UserError(f"{field}: {where} needs an image path string")
    p = Path(value)
    p = p if p.is_absolute() else base / p
    if not p.is_file():
        raise UserError(f"{field}: {where}: image {p} does not exist; fix the path or remove the row")
    return str(p)


def read_caption_pairs(path: str | Path, field: str = "trainer.pairs") -> PromptSet:
    """(image, caption) pairs as a :class:`PromptSet` whose metadata holds ``{"image": absolute path}``."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"{field}: {path} does not exist; give a folder of image + .txt caption files or a JSONL "
                        'file of {"image": ..., "prompt": ...} lines')
    prompts, metadata = [], []
    if path.is_dir():
        for image in sorted(p for p in path.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES):
            caption = image.with_suffix(".txt")
            if not caption.is_file():
                raise UserError(f"{field}: {image} has no caption file {caption.name} beside it")
            prompts.append(caption.read_text().strip())
            metadata.append({"image": str(image.resolve())})
        if not prompts:
            raise UserError(f"{field}: folder {path} holds no images ({', '.join(IMAGE_SUFFIXES)}) with captions")
    else:
        for i, row in enumerate(_read_jsonl(path, field), 1):
            caption = next((row[k] for k in CAPTION_KEYS if isinstance(row.get(k), str)), None)
            if caption is None:
                raise UserError(f'{field}: {path}:{i} needs a caption string ("prompt", "caption" or "text")')
            prompts.append(caption)
            metadata.append({"image": _resolve(path.parent.resolve(), row.get("image"), field, f"{path}:{i}")})
    return PromptSet(prompts, metadata)


def read_preference_pairs(path: str | Path, field: str = "trainer.pairs") -> PromptSet:
    """Preference triples as a :class:`PromptSet` whose metadata holds ``{"chosen": path, "rejected": path}``."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f'{field}: {path} is not a file; give a JSONL file of {{"prompt", "chosen", "rejected"}} lines')
    prompts, metadata = [], []
    for i, row in enumerate(_read_jsonl(path, field), 1):
        if not isinstance(row.get("prompt"), str):
            raise UserError(f'{field}: {path}:{i} needs a "prompt" string')
        base = path.parent.resolve()
        prompts.append(row["prompt"])
        metadata.append({k: _resolve(base, row.get(k), field, f"{path}:{i} {k!r}") for k in ("chosen", "rejected")})
    return PromptSet(prompts, metadata)


def load_image(path: str | Path, height: int, width: int) -> torch.Tensor:
    """An image file as ``(3, height, width)`` float32 in [0, 1]: scaled to cover, then centre-cropped."""
    from PIL import Image

    from flowalign.media import open_image

    with open_image(path, "image") as im:  # not an image, or too many pixels: one line, before decoding
        im = im.convert("RGB")
        scale = max(height / im.height, width / im.width)
        size = (max(width, round(im.width * scale)), max(height, round(im.height * scale)))
        if size != im.size:
            im = im.resize(size, Image.Resampling.BICUBIC)
        left, top = (im.width - width) // 2, (im.height - height) // 2
        im = im.crop((left, top, left + width, top + height))
        array = np.asarray(im, dtype=np.float32) / 255.0
    return torch.from_numpy(array.copy()).permute(2, 0, 1)
