"""Any accepted video form → one ``(F, H, W, 3)`` uint8 clip, or :class:`BadVideo` saying what is wrong.

Accepted: an ``(F, H, W, 3)`` uint8 (or float) numpy array, an ``(F, 3, H, W)`` float tensor/array in
[0, 1] (a 4th alpha channel is dropped), a list of PIL images or of ``(H, W, 3)`` arrays, or the path
of a video file (read with imageio: mp4 through ffmpeg, gif, ...). Floats follow VVR's convention:
[0, 1] unless clearly 0-255. Frames must be at least VVR's ``MIN_SIDE`` (16 px); a clip that is one
colour throughout is refused, while single blank frames are fine (an object may appear later).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch
from PIL import Image

from flowalign.errors import UserError
from rewards.vvr.verify import MIN_SIDE, as_array, pixels_uint8

_SINGLE_IMAGE = "a video reward needs (F,3,H,W) clips; got a single image"
_GREY_MODES = frozenset({"1", "L", "LA", "I", "I;16", "F"})


class BadVideo(Exception):
    """The input cannot be read as a clip; the message is the reason shown in verdicts."""


def _read_file(path: str | os.PathLike) -> np.ndarray:
    import imageio.v3 as iio

    try:
        return np.asarray(iio.imread(os.fspath(path), index=None))
    except Exception as e:  # imageio raises many types (OSError, ValueError, plugin errors)
        raise BadVideo(f"cannot read video file {os.fspath(path)!r}: {type(e).__name__}: {e}") from e


def _frame(x: Any, i: int) -> np.ndarray:
    if isinstance(x, Image.Image):
        if x.mode in _GREY_MODES:
            raise BadVideo(f"frame {i} is grayscale (PIL mode {x.mode!r}); expected RGB frames")
        return np.asarray(x.convert("RGB"))
    arr = as_array(x)
    if arr is None:
        raise BadVideo(f"frame {i} is a {type(x).__name__}; expected PIL images or arrays")
    return arr


def as_clip(video: Any) -> np.ndarray:
    """``video`` (see the module docstring) → ``(F, H, W, 3)`` uint8 with F ≥ 2, or :class:`BadVideo`."""
    if isinstance(video, (str, os.PathLike)):
        arr = _read_file(video)
    elif isinstance(video, Image.Image):
        raise BadVideo(_SINGLE_IMAGE)
    elif isinstance(video, (list, tuple)):
        if not video:
            raise BadVideo("empty list of frames")
        frames = [_frame(x, i) for i, x in enumerate(video)]
        shapes = {f.shape for f in frames}
        if len(shapes) > 1:
            raise BadVideo(f"frames differ in shape: {sorted(shapes)}")
        arr = np.stack(frames)
    elif (arr := as_array(video)) is None:
        raise BadVideo(f"unreadable video of type {type(video).__name__}; expected numpy, torch, PIL frames or a path")
    if arr.ndim == 2 or arr.ndim == 3 and (arr.shape[0] in (1, 3, 4) or arr.shape[-1] in (1, 3, 4)):
        raise BadVideo(f"{_SINGLE_IMAGE} of shape {tuple(arr.shape)}")
    if arr.ndim == 3:
        raise BadVideo(f"grayscale clip of shape {tuple(arr.shape)}; expected (F,3,H,W) colour frames")
    if arr.ndim == 5:
        raise BadVideo(f"a batch of clips {tuple(arr.shape)}; pass one (F,3,H,W) clip at a time")
    if arr.ndim != 4:
        raise BadVideo(f"wrong video shape {tuple(arr.shape)}; expected (F,3,H,W) or (F,H,W,3)")
    if arr.shape[1] in (1, 3, 4) and arr.shape[-1] not in (1, 3, 4):
        arr = np.moveaxis(arr, 1, -1)  # channels first, as tensors come
    if arr.shape[-1] not in (3, 4):
        raise BadVideo(f"wrong video shape {tuple(arr.shape)}; expected 3 colour channels, (F,3,H,W) or (F,H,W,3)")
    if arr.shape[0] < 2:
        raise BadVideo(f"{_SINGLE_IMAGE} (a clip of {arr.shape[0]} frame)")
    arr = pixels_uint8(arr[..., :3])
    if arr is None:
        raise BadVideo("video has NaN or infinite values")
    if min(arr.shape[1:3]) < MIN_SIDE:
        raise BadVideo(f"frames too small ({arr.shape[2]}x{arr.shape[1]}); need at least {MIN_SIDE} px")
    if np.ptp(arr.reshape(-1, 3), axis=0).max() < 4:
        raise BadVideo("blank video (a single colour throughout)")
    return np.ascontiguousarray(arr)


def batch_clips(samples: torch.Tensor, reward: str) -> tuple[np.ndarray, list[bool]]:
    """A reward's ``(B, F, 3, H, W)`` float batch in [0, 1] → (``(B, F, H, W, 3)`` uint8, finite per sample).

    Decoded samples may overshoot [0, 1] a little, so they are clamped here rather than read by
    :func:`as_clip` (which would take a max above 1 for a 0-255 clip). A batch of another rank is a
    wiring error (an image model given a video reward), raised as ``UserError``, not a sample to mask.
    """
    if samples.ndim != 5 or samples.shape[2] != 3:
        kind = "a batch of images" if samples.ndim == 4 else "samples"
        raise UserError(
            f"{reward}: a video reward needs (B,F,3,H,W) clips; got {kind} of shape {tuple(samples.shape)}"
            + (" (use the 'vvr' reward for image models)" if samples.ndim == 4 else "")
        )
    finite = torch.isfinite(samples).flatten(1).all(1).tolist()
    pixels = (samples.detach().float().nan_to_num(0.0).clamp(0, 1) * 255).round().to(torch.uint8)
    return pixels.permute(0, 1, 3, 4, 2).cpu().numpy(), finite
