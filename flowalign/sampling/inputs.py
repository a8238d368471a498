"""Per-prompt input images (editing, image-to-video): read them and hand them to the policies that take them.

A prompt's conditioning image travels in its metadata as ``metadata["image"]`` (a path, a PIL image, a
``(3, H, W)`` tensor in [0, 1], or a callable rendering one on use); :func:`flowalign.data.read_prompt_file`
resolves JSONL ``image`` paths against the file's folder. Policies that condition on an image set
``input_images = True`` and take ``encode(prompts, images=[...])``; every other policy is called as before,
``encode(prompts)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from flowalign.errors import UserError
from flowalign.protocols import Conditioning


def load_input_image(source: Any) -> torch.Tensor:
    """A conditioning image as ``(3, H, W)`` float32 in [0, 1] from a path, a PIL image, a tensor, or a
    zero-argument callable returning one of these (an image rendered on use, e.g. a benchmark's scene)."""
    if callable(source) and not isinstance(source, (torch.Tensor, Image.Image)):
        source = source()
    if isinstance(source, torch.Tensor):
        image = source.detach().float().cpu()
        if image.ndim != 3 or image.shape[0] != 3:
            raise UserError(f"input image tensor must be (3, H, W) in [0, 1], got shape {tuple(image.shape)}")
        return image.clamp(0, 1)
    if isinstance(source, (str, Path)):
        path = Path(source)
        if not path.is_file():
            raise UserError(f"input image {str(path)!r} does not exist: give a PNG/JPEG path (JSONL paths are relative "
                            "to the file)")
        from flowalign.media import open_image

        source = open_image(path, "input image")  # its size checked from the header, before decoding
    if not isinstance(source, Image.Image):
        raise UserError(f"input image must be a path, a PIL image or a tensor, got {type(source).__name__}")
    try:
        rgb = source.convert("RGB")
    except (OSError, ValueError) as err:  # a truncated or corrupt file fails only when decoded
        name = getattr(source, "filename", "") or "input image"
        raise UserError(f"input image {name}: cannot be decoded ({str(err).splitlines()[0][:120]}); give a PNG or "
                        "JPEG") from None
    array = np.asarray(rgb, dtype=np.float32) / 255.0
    return torch.from_numpy(array).permute(2, 0, 1).contiguous()


def encode_prompts(policy: Any, prompts: list[str], metadata: Sequence[dict[str, Any]]) -> Conditioning:
    """``policy.encode`` with each prompt's ``metadata["image"]`` when the policy conditions on images."""
    if not getattr(policy, "input_images", False):
        if any(m.get("image") is not None for m in metadata):
            raise UserError(f"the prompts carry input images (metadata 'image'), but {policy.family} models take none: "
                            "use an editing or image-to-video model (a family whose policy takes input images)")
        return policy.encode(prompts)
    images = [m.get("image") for m in metadata]
    missing = [i for i, image in enumerate(images) if image is None]
    if missing:
        raise UserError(f"{policy.family} edits an input image, but prompt {missing[0]} ({prompts[missing[0]]!r:.60}) "
                        "has none: give each prompt an `image` (JSONL field, or --image for flowalign sample)")
    return policy.encode(prompts, images=images)
