"""What the image rewards share: input checks and the batched, device/dtype-aware scoring loop.

:class:`BatchedImageReward` is the base of the model-backed rewards (CLIP score, aesthetic,
preference models, LPIPS). A subclass provides ``context`` (per-sample conditioning such as text
embeddings or reference images, computed once per call) and ``score_batch`` (one batch of images and
its context rows to scores); the base validates the input, moves everything to the compute device,
splits the batch and masks non-finite samples. :class:`EmbeddingReward` is the base of those that score an
image embedding (the CLIP-based ones): it splits ``score_batch`` into ``embed`` and ``score_features`` and
so offers both halves apart (:class:`flowalign.protocols.FeatureReward`).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from flowalign.errors import UserError
from flowalign.protocols import NotSized, RewardOutput
from rewards.model_options import compute_device, resolve_batch_size, resolve_device, resolve_dtype
from rewards.planning import module_bytes, on_accelerator, option

# decoders clamp to [0, 1]; a little slack admits bf16 rounding and interpolation overshoot
RANGE_TOLERANCE = 1e-3

def check_images(samples: Any, who: str) -> None:
    """Raise :class:`UserError` unless ``samples`` is a float ``(B, 3, H, W)`` tensor in [0, 1].

    Non-finite values are allowed here: they make their sample invalid rather than the call fail.
    """
    if not isinstance(samples, torch.Tensor):
        raise UserError(f"{who} reward: samples must be a torch.Tensor (B, 3, H, W); got {type(samples).__name__}")
    if samples.ndim == 5:
        raise UserError(
            f"{who} reward scores images (B, 3, H, W); got a video batch of shape {tuple(samples.shape)}:"
            f" use rewards.video.per_frame({who!r}) or the '{who}_video' reward"
        )
    if samples.ndim != 4 or samples.shape[1] != 3:
        raise UserError(f"{who} reward: samples must have shape (B, 3, H, W) (RGB); got {tuple(samples.shape)}")
    check_unit_range(samples, who)


def constant(values: Any, like: torch.Tensor) -> torch.Tensor:
    """``values`` (numbers, or nested lists or tuples of them) as a tensor of ``like``'s dtype on its device,
    copied there once per process and shared: a copy from the host at every call would make the host wait
    for all the work queued on a GPU. Read it; never write into it."""
    return _constant(_frozen(values), like.device, like.dtype, type(like))


def _frozen(values: Any) -> Any:
    return tuple(_frozen(v) for v in values) if isinstance(values, (list, tuple)) else values


@functools.lru_cache(maxsize=256)
def _constant(values: Any, device: torch.device, dtype: torch.dtype, kind: type) -> torch.Tensor:
    # ``kind``: a tensor subclass on the same device (a test's emulated device) keeps its own copy
    return torch.tensor(values, dtype=dtype, device=device)


def check_unit_range(samples: torch.Tensor, who: str) -> None:
    """Raise :class:`UserError` unless ``samples`` (images or videos) are float with every finite value in
    [0, 1] (to :data:`RANGE_TOLERANCE`); non-finite values are left to make their sample invalid."""
    if not samples.is_floating_point():
        raise UserError(
            f"{who} reward: samples must be float in [0, 1]; got dtype {samples.dtype}"
            " (convert uint8 images with x.float() / 255)"
        )
    # the extremes over the finite values, masked rather than indexed, and read back together: one host wait
    x = samples.detach()
    if not x.numel():
        return
    finite = torch.isfinite(x)
    lo, hi = torch.stack([torch.where(finite, x, torch.inf).amin(), torch.where(finite, x, -torch.inf).amax()]).tolist()
    if lo < -RANGE_TOLERANCE or hi > 1 + RANGE_TOLERANCE:  # no finite value: lo = inf, hi = -inf pass
        raise UserError(
            f"{who} reward: samples must lie in [0, 1]; got values in [{lo:.3g}, {hi:.3g}]"
            " (map [-1, 1] decoder outputs with (x + 1) / 2)"
        )


def check_lengths(n: int, prompts: list[str], metadata: list[dict[str, Any]], who: str) -> None:
    """One prompt per sample; ``metadata`` is empty or has one dict per sample."""
    if len(prompts) != n:
        raise UserError(f"{who} reward: got {n} samples but {len(prompts)} prompts; give one prompt per sample")
    if metadata and len(metadata) != n:
        raise UserError(f"{who} reward: got {n} samples but {len(metadata)} metadata dicts; give one per sample")


def finite_mask(samples: torch.Tensor) -> torch.Tensor:
    """``(B,)`` bool: the samples without NaN or infinite values."""
    return torch.isfinite(samples.detach()).flatten(1).all(1)


class BatchedImageReward:
    """Base of the model-backed image rewards (see the module docstring).

    Options shared by every subclass: ``batch_size`` (images per forward pass), ``device`` (None: the
    samples' device) and ``dtype`` (model compute dtype; preprocessing and scores stay float32).
    """

    name: str
    differentiable = True

    def __init__(self, *, batch_size: int = 32, device: str | torch.device | None = None,
                 dtype: str | torch.dtype = "float32"):
        self.batch_size = resolve_batch_size(batch_size, self.name)
        self.device = resolve_device(device, self.name)
        self.dtype = resolve_dtype(dtype, self.name)

    def modules(self) -> list[torch.nn.Module]:
        """The frozen networks to move to the compute device."""
        raise NotImplementedError

    @classmethod
    def planned_bytes(cls, options: dict[str, Any]) -> int:
        """Bytes of :meth:`planned_modules` in the reward's ``dtype`` (:class:`flowalign.protocols.SizedReward`);
        0 where its ``device`` option keeps them on the CPU."""
        if not on_accelerator(option(cls, options, "device")):
            return 0
        dtype = resolve_dtype(option(cls, options, "dtype"), cls.name)
        return module_bytes(m.to(dtype) for m in cls.planned_modules(options))

    @classmethod
    def planned_modules(cls, options: dict[str, Any]) -> list[torch.nn.Module]:
        """The networks :meth:`modules` would return for a reward built with ``options``, built on the meta
        device from their configs; raises :class:`flowalign.protocols.NotSized` where they cannot be."""
        raise NotSized("it does not say which networks it loads (no planned_modules)")

    def context(self, prompts: list[str], metadata: list[dict[str, Any]], samples: torch.Tensor,
                device: torch.device) -> tuple[torch.Tensor, ...]:
        """Per-sample conditioning, each tensor ``(B, ...)`` on ``device``; sliced along with the images."""
        return ()

    def score_batch(self, images: torch.Tensor, *context: torch.Tensor) -> torch.Tensor:
        """``images`` ``(b, 3, H, W)`` float32 in [0, 1] on the compute device → scores ``(b,)``."""
        raise NotImplementedError

    def __call__(self, samples: torch.Tensor, prompts: list[str], metadata: list[dict[str, Any]]) -> RewardOutput:
        """``samples`` ``(B, 3, H, W)`` float in [0, 1] → ``{name: (B,) float32}`` and ``valid`` ``(B,)``.

        Scores and ``valid`` live on the samples' device; gradients flow to ``samples`` when
        ``differentiable``. A sample with non-finite values is scored on zeros and marked invalid, so
        it cannot poison the scores of the others.
        """
        images, valid, device = self.prepared(samples, prompts, metadata)
        context = self.context(prompts, metadata, samples, device)
        scores = torch.cat([
            self.score_batch(images[i : i + self.batch_size], *(c[i : i + self.batch_size] for c in context))
            for i in range(0, samples.shape[0], self.batch_size)
        ])
        return RewardOutput({self.name: scores.float().to(samples.device)}, valid=valid)

    def prepared(self, samples: torch.Tensor, prompts: list[str], metadata: list[dict[str, Any]]
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.device]:
        """Checked ``samples`` as float32 images on the compute device (zeros where non-finite), their
        validity ``(B,)`` and the device; the networks are moved there."""
        check_images(samples, self.name)
        check_lengths(samples.shape[0], prompts, metadata, self.name)
        device = compute_device(self.device, samples)
        for module in self.modules():
            module.to(device)
        valid = finite_mask(samples)
        images = torch.where(valid[:, None, None, None], samples, torch.zeros_like(samples))
        return images.to(device, torch.float32), valid, device


class EmbeddingReward(BatchedImageReward):
    """A model-backed reward that scores an image embedding: ``score_batch = score_features(embed(images),
    *context)``. A subclass gives ``embed`` and ``score_features``; the two public halves, ``features`` and
    ``feature_scores``, let a trainer work in the reward's own feature space (FAV's particles)."""

    def embed(self, images: torch.Tensor) -> torch.Tensor:
        """``images`` ``(b, 3, H, W)`` float32 in [0, 1] on the compute device → embeddings ``(b, D)``."""
        raise NotImplementedError

    def score_features(self, features: torch.Tensor, *context: torch.Tensor) -> torch.Tensor:
        """Embeddings ``(b, D)`` and their context rows → scores ``(b,)``."""
        raise NotImplementedError

    def score_batch(self, images: torch.Tensor, *context: torch.Tensor) -> torch.Tensor:
        return self.score_features(self.embed(images), *context)

    def features(self, samples: torch.Tensor, prompts: list[str], metadata: list[dict[str, Any]]) -> torch.Tensor:
        """Decoded samples ``(B, 3, H, W)`` in [0, 1] → embeddings ``(B, D)`` float32 on the samples' device,
        differentiable in ``samples`` (a non-finite sample is embedded as zeros, as ``__call__`` scores it)."""
        images, _, _ = self.prepared(samples, prompts, metadata)
        return torch.cat([self.embed(images[i : i + self.batch_size])
                          for i in range(0, samples.shape[0], self.batch_size)]).float().to(samples.device)

    def feature_scores(self, features: torch.Tensor, prompts: list[str],
                       metadata: list[dict[str, Any]]) -> torch.Tensor:
        """Embeddings ``(B, D)`` → scores ``(B,)`` float32, differentiable in ``features``; equal to
        ``__call__``'s on the samples the embeddings are of. (The context of these rewards reads the prompts
        only, so it is given the embeddings in the samples' place.)"""
        check_lengths(features.shape[0], prompts, metadata, self.name)
        device = compute_device(self.device, features)
        for module in self.modules():
            module.to(device)
        f = features.to(device, torch.float32)
        context = self.context(prompts, metadata, features, device)
        return torch.cat([
            self.score_features(f[i : i + self.batch_size], *(c[i : i + self.batch_size] for c in context))
            for i in range(0, features.shape[0], self.batch_size)
        ]).float().to(features.device)


def check_jpeg_quality(quality: Any, who: str, also: str = "") -> None:
    """Refuse a ``jpeg_quality`` that is not an integer from 1 to 100 or null (lossless); ``also`` names further
    accepted words (``" or auto"``)."""
    if quality is not None and (isinstance(quality, bool) or not isinstance(quality, int) or not 1 <= quality <= 100):
        raise UserError(f"{who} reward: jpeg_quality={quality!r} must be an integer from 1 to 100, null (lossless){also}")


def jpeg_round_trip(image: Any, quality: int) -> Any:
    """An 8-bit RGB PIL image after a JPEG at ``quality`` (PIL's encoder and its defaults) and back: what a
    scorer fed JPEG files reads."""
    import io

    from PIL import Image

    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=quality)
    return Image.open(io.BytesIO(buffer.getvalue())).convert("RGB")


def to_pil(image: torch.Tensor) -> Any:
    """``(3, H, W)`` float in [0, 1] → an 8-bit RGB PIL image (what OCR engines and VLM processors read)."""
    from PIL import Image

    pixels = (image.detach().float().clamp(0, 1) * 255).round().to(torch.uint8)
    return Image.fromarray(pixels.permute(1, 2, 0).cpu().numpy(), "RGB")
