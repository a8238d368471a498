"""Samples a person can open: PNG images, MP4 videos (GIF fallback) and first-frame posters written, and
image files read with their size checked before they are decoded."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from flowalign.errors import UserError
from flowalign.io import atomic_path
from flowalign.limits import MAX_IMAGE_PIXELS

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp")
VIDEO_SUFFIXES = (".mp4", ".gif")


def open_image(path: str | Path, what: str) -> Image.Image:
    """The image file ``path`` opened from its header only (``what`` names it in errors, e.g. ``--image``).

    A file that is not an image, and one of more than :data:`flowalign.limits.MAX_IMAGE_PIXELS` pixels, is
    refused in one line before a pixel is decoded: PIL reads only the header here, and decoding a 13000 x 13000
    PNG would take 0.5 GB as bytes and 1.9 GB more as floats."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{what} {path}: no such file; give a PNG or JPEG")
    try:
        with warnings.catch_warnings():  # PIL's bomb warning: the size is checked below, with a clearer message
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(path)
    except (UnidentifiedImageError, Image.DecompressionBombError, OSError, ValueError) as err:
        reason = "not an image file" if isinstance(err, UnidentifiedImageError) else str(err).splitlines()[0][:120]
        raise UserError(f"{what} {path}: cannot be read as an image ({reason}); give a PNG or JPEG") from None
    width, height = image.size
    if width * height > MAX_IMAGE_PIXELS:
        image.close()
        raise UserError(f"{what} {path}: {width}x{height} = {width * height:,} pixels, more than the "
                        f"{MAX_IMAGE_PIXELS:,} an input image may have; downscale it (e.g. to 1024 x 1024)")
    return image


def to_uint8(x: torch.Tensor) -> np.ndarray:
    """``(3,H,W)`` → ``(H,W,3)`` or ``(F,3,H,W)`` → ``(F,H,W,3)`` uint8, from floats in [0,1]."""
    x = x.detach().float().clamp(0, 1).mul(255).round().to(torch.uint8).cpu()
    return x.movedim(-3, -1).numpy()


def save_image(image: torch.Tensor, path: str | Path) -> Path:
    """Save a ``(3,H,W)`` float image in [0,1]."""
    path = Path(path)
    if path.suffix.lower() not in IMAGE_SUFFIXES:
        raise UserError(f"cannot write an image to {path.name!r}: use one of {', '.join(IMAGE_SUFFIXES)}")
    with atomic_path(path) as tmp:
        Image.fromarray(to_uint8(image)).save(tmp, format=_pil_format(path))
    return path


def _pil_format(path: Path) -> str:
    return {".jpg": "JPEG", ".jpeg": "JPEG"}.get(path.suffix.lower(), path.suffix.lower().lstrip(".").upper())


def save_video(video: torch.Tensor, path: str | Path, fps: int = 8) -> Path:
    """Save a ``(F,3,H,W)`` float video in [0,1] as MP4 (H.264 via imageio-ffmpeg) or GIF.

    If MP4 encoding is unavailable the clip is written as GIF beside it and that path returned.
    """
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in VIDEO_SUFFIXES:
        raise UserError(f"cannot write a video to {path.name!r}: use .mp4 or .gif")
    frames = to_uint8(video)
    if suffix == ".mp4":
        try:
            return _write_mp4(frames, path, fps)
        except (ImportError, RuntimeError, OSError):
            path = path.with_suffix(".gif")
    import imageio.v3 as iio

    with atomic_path(path) as tmp:
        iio.imwrite(tmp, frames, extension=".gif", duration=1000 / fps, loop=0)
    return path


def _write_mp4(frames: np.ndarray, path: Path, fps: int) -> Path:
    import imageio

    # H.264 needs even sides; pad by edge replication rather than resample
    f, h, w, _ = frames.shape
    frames = np.pad(frames, ((0, 0), (0, h % 2), (0, w % 2), (0, 0)), mode="edge")
    with atomic_path(path) as tmp:
        with imageio.get_writer(tmp, format="FFMPEG", mode="I", fps=fps, codec="libx264",
                                pixelformat="yuv420p", macro_block_size=1) as writer:
            for frame in frames:
                writer.append_data(frame)
    return path


def save_poster(video: torch.Tensor, path: str | Path) -> Path:
    """The first frame of a ``(F,3,H,W)`` video as an image (gallery posters)."""
    return save_image(video[0], path)


def load_video(path: str | Path) -> torch.Tensor:
    """A video file (``.mp4`` through imageio-ffmpeg, ``.gif``) as ``(F, 3, H, W)`` float32 in [0, 1]."""
    import imageio.v3 as iio

    path = Path(path)
    if path.suffix.lower() not in VIDEO_SUFFIXES:
        raise UserError(f"cannot read a video from {path.name!r}: use .mp4 or .gif")
    if not path.is_file():
        raise UserError(f"video {str(path)!r} does not exist")
    try:
        frames = np.asarray(iio.imread(path, index=None))
    except (OSError, ValueError, RuntimeError) as err:
        raise UserError(f"cannot read video {str(path)!r} ({err}): write it as H.264 MP4 or GIF") from err
    if frames.ndim == 3:  # a single greyscale or single-frame file
        frames = frames[None]
    if frames.shape[-1] == 4:
        frames = frames[..., :3]
    return torch.from_numpy(np.ascontiguousarray(frames)).float().div(255).movedim(-1, -3)
