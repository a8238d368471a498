"""The degradation pipeline of the ``sr`` benchmark: HR image → LR image, deterministic from a seed.

A classical first-order real-world degradation (the order Real-ESRGAN's first stage uses): Gaussian
**blur** (σ in HR pixels) → **downscale** by an integer factor 2-4 (bicubic, antialiased) → additive
Gaussian **noise** (σ in [0, 1] units, per pixel and channel, from ``numpy.random.default_rng(seed)``) →
**JPEG** re-encoding at a quality. Downscaling is always applied; each other kind is present or absent
per task and its strength is drawn from the level's range (:data:`STRENGTHS`), so every level mixes kinds
and ``hard`` is stronger on every axis than ``easy``.
"""

from __future__ import annotations

import io
import random
from dataclasses import asdict, dataclass
from typing import Any, Mapping

import numpy as np
from PIL import Image, ImageFilter

KINDS: tuple[str, ...] = ("blur", "downscale", "noise", "jpeg")
#: level → kind → (low, high) strength range; ``scale`` is drawn from the integers in its range
STRENGTHS: dict[str, dict[str, tuple[float, float]]] = {
    "easy": {"scale": (2, 2), "blur": (0.3, 1.0), "noise": (0.005, 0.02), "jpeg": (70, 95)},
    "medium": {"scale": (2, 3), "blur": (0.6, 1.6), "noise": (0.01, 0.04), "jpeg": (40, 80)},
    "hard": {"scale": (3, 4), "blur": (1.0, 2.4), "noise": (0.02, 0.07), "jpeg": (20, 50)},
}
#: how often each optional kind is present in a draw
PRESENT = {"blur": 0.8, "noise": 0.6, "jpeg": 0.6}


@dataclass(frozen=True)
class Degradation:
    """One draw: ``scale`` (integer factor), ``blur`` (Gaussian σ in HR pixels, 0: none), ``noise`` (std in
    [0, 1] units, 0: none), ``jpeg`` (quality 1-100, 0: none), ``seed`` (the noise generator's seed)."""

    scale: int
    blur: float = 0.0
    noise: float = 0.0
    jpeg: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.scale <= 8:
            raise ValueError(f"degradation.scale: {self.scale} must lie in [1, 8]")
        if self.blur < 0 or self.noise < 0 or not 0 <= self.jpeg <= 100:
            raise ValueError(f"degradation: blur and noise must be >= 0 and jpeg in [0, 100], got {self}")

    @property
    def kinds(self) -> tuple[str, ...]:
        """The kinds this draw applies, in pipeline order."""
        present = {"blur": self.blur > 0, "downscale": self.scale > 1, "noise": self.noise > 0, "jpeg": self.jpeg > 0}
        return tuple(k for k in KINDS if present[k])

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> "Degradation":
        return Degradation(int(d["scale"]), float(d.get("blur", 0.0)), float(d.get("noise", 0.0)),
                           int(d.get("jpeg", 0)), int(d.get("seed", 0)))


def draw_degradation(rng: random.Random, level: str) -> Degradation:
    """A degradation of ``level``'s strengths (:data:`STRENGTHS`), from ``rng``."""
    if level not in STRENGTHS:
        raise ValueError(f"level: {level!r} is not allowed; allowed values: {', '.join(STRENGTHS)}")
    s = STRENGTHS[level]
    scale = rng.randint(int(s["scale"][0]), int(s["scale"][1]))
    blur = round(rng.uniform(*s["blur"]), 3) if rng.random() < PRESENT["blur"] else 0.0
    noise = round(rng.uniform(*s["noise"]), 4) if rng.random() < PRESENT["noise"] else 0.0
    jpeg = int(rng.uniform(*s["jpeg"])) if rng.random() < PRESENT["jpeg"] else 0
    return Degradation(scale, blur, noise, jpeg, rng.randrange(2**31))


def lr_size(hr_size: int, scale: int) -> int:
    """The LR side of an ``hr_size`` image downscaled by ``scale`` (rounded, at least 8 px)."""
    return max(8, round(hr_size / scale))


def degrade(hr: Image.Image, d: Degradation) -> Image.Image:
    """The LR image of ``hr`` under ``d`` (see the module docstring); the same inputs give the same bytes."""
    image = hr.convert("RGB")
    if d.blur > 0:
        image = image.filter(ImageFilter.GaussianBlur(radius=d.blur))
    if d.scale > 1:
        w, h = image.size
        image = image.resize((lr_size(w, d.scale), lr_size(h, d.scale)), Image.Resampling.BICUBIC)
    if d.noise > 0:
        pixels = np.asarray(image, dtype=np.float32) / 255.0
        pixels = pixels + np.random.default_rng(d.seed).normal(0.0, d.noise, pixels.shape).astype(np.float32)
        image = Image.fromarray((pixels.clip(0, 1) * 255).round().astype(np.uint8))
    if d.jpeg > 0:
        buffer = io.BytesIO()
        image.save(buffer, format="JPEG", quality=d.jpeg)
        buffer.seek(0)
        with Image.open(buffer) as decoded:
            image = decoded.convert("RGB")
    return image
