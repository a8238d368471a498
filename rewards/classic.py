"""Classic model-free rewards: JPEG (in)compressibility (DDPO's), brightness and saturation.

No weights, no prompts: cheap sanity rewards that a tiny model can learn in minutes, handy for
checking that a training setup moves a reward at all.
"""

from __future__ import annotations

import io
from typing import Any

import torch
from PIL import Image

from flowalign.errors import UserError
from flowalign.protocols import RewardOutput
from rewards.common import check_images, check_lengths, constant, finite_mask
from rewards.planning import holds_nothing
from rewards.registry import register

# Rec. 709 luma weights (sRGB primaries)
LUMA = (0.2126, 0.7152, 0.0722)
# saturation's denominator offset: bounds the gradient near black (|d/d min| <= 100) for <= 1% of the value
SATURATION_EPS = 1e-2


def jpeg_kilobytes(samples: torch.Tensor, quality: int) -> torch.Tensor:
    """Size in kB (1000 bytes) of each ``(3, H, W)`` image saved as an 8-bit JPEG at ``quality`` → ``(B,)``."""
    pixels = (samples.detach().float().nan_to_num(0.0).clamp(0, 1) * 255).round().to(torch.uint8)
    sizes = []
    for image in pixels.permute(0, 2, 3, 1).cpu().numpy():
        buffer = io.BytesIO()
        Image.fromarray(image).save(buffer, format="JPEG", quality=quality)
        sizes.append(buffer.tell() / 1000)
    return torch.tensor(sizes, dtype=torch.float32)


class _JPEGSize:
    """``sign · JPEG size in kB``; not differentiable (the encoder is not)."""

    name: str
    sign: float
    differentiable = False
    #: a program, no model: nothing on the device (flowalign plan)
    planned_bytes = staticmethod(holds_nothing)

    def __init__(self, quality: int = 95):
        if not isinstance(quality, int) or not 1 <= quality <= 100:
            raise UserError(f"{self.name} reward: quality must be an integer in [1, 100], got {quality!r}")
        self.quality = quality

    def __call__(self, samples: torch.Tensor, prompts: list[str], metadata: list[dict[str, Any]]) -> RewardOutput:
        """``samples`` ``(B, 3, H, W)`` float in [0, 1] → ``{name: (B,)}``; non-finite samples invalid."""
        check_images(samples, self.name)
        check_lengths(samples.shape[0], prompts, metadata, self.name)
        score = self.sign * jpeg_kilobytes(samples, self.quality)
        return RewardOutput({self.name: score.to(samples.device)}, valid=finite_mask(samples))


@register("jpeg_compressibility")
class JPEGCompressibility(_JPEGSize):
    """``−kB`` of the JPEG at ``quality`` (default 95, as DDPO): higher for simpler images."""

    name = "jpeg_compressibility"
    sign = -1.0


@register("jpeg_incompressibility")
class JPEGIncompressibility(_JPEGSize):
    """``+kB`` of the JPEG at ``quality`` (default 95, as DDPO): higher for busier images."""

    name = "jpeg_incompressibility"
    sign = 1.0


class _PixelStatistic:
    """A differentiable per-image mean of a pixel statistic, in [0, 1]."""

    name: str
    differentiable = True
    #: a program, no model: nothing on the device (flowalign plan)
    planned_bytes = staticmethod(holds_nothing)

    @staticmethod
    def statistic(images: torch.Tensor) -> torch.Tensor:
        """``(B, 3, H, W)`` → per-pixel values ``(B, H, W)`` in [0, 1]."""
        raise NotImplementedError

    def __call__(self, samples: torch.Tensor, prompts: list[str], metadata: list[dict[str, Any]]) -> RewardOutput:
        """``samples`` ``(B, 3, H, W)`` float in [0, 1] → ``{name: (B,) float32}``; non-finite samples invalid."""
        check_images(samples, self.name)
        check_lengths(samples.shape[0], prompts, metadata, self.name)
        valid = finite_mask(samples)
        images = torch.where(valid[:, None, None, None], samples, torch.zeros_like(samples)).float()
        return RewardOutput({self.name: self.statistic(images).mean((1, 2))}, valid=valid)


@register("brightness")
class Brightness(_PixelStatistic):
    """Mean Rec. 709 luma of the (gamma-encoded) pixels."""

    name = "brightness"

    @staticmethod
    def statistic(images: torch.Tensor) -> torch.Tensor:
        weights = constant(LUMA, images)
        return torch.einsum("bchw,c->bhw", images, weights)


@register("saturation")
class Saturation(_PixelStatistic):
    """Mean HSV saturation ``(max − min) / (max + ε)`` over the RGB channels (ε = ``SATURATION_EPS``)."""

    name = "saturation"

    @staticmethod
    def statistic(images: torch.Tensor) -> torch.Tensor:
        high, low = images.amax(1), images.amin(1)
        return (high - low) / (high + SATURATION_EPS)
