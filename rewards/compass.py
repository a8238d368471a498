"""COMPASS-style rewards of an LR → SR transition: ``compass`` (reference-free) and ``compass_fr`` (with HR).

OARS (arXiv 2603.12811) scores a super-resolved image by how it got there from its LR input: fidelity
preservation and perceptual gain, traded off by how good the input already was. The paper's COMPASS is a
fine-tuned MLLM; this module is a weight-free measurement of the same three parts (or, with ``path``, a
quality model for the gain), per sample, with ``x`` the SR output ``(3, H, W)`` and ``y`` the LR input
``(3, h, w)``, both in [0, 1]:

* **fidelity** ``F = SSIM(down(x), y)`` (mean over RGB of SSIM with a Gaussian window σ = 1.5, reflect
  padding), ``down``: bicubic, antialiased, to the LR size. An output that keeps the input's structure
  (degraded back to the input's size, it *is* the input) scores near 1.
* **perceptual gain** ``G = tanh(log((Q(x) + ε) / (Q(up(y)) + ε)) / τ)`` in (−1, 1), ``up``: bicubic to
  the output size, ``τ`` = ``gain_temperature``. With no ``path``, ``Q`` is the Laplacian energy
  ``mean((∇²luma)²)`` (a no-weights sharpness measure): the identity upscale has ``G = 0``, a blurrier
  output ``G < 0``, a sharper one ``G > 0``. With ``path`` (a quality model's weights, read by the reward
  ``quality_model``, default ``aesthetic``), ``G = tanh((Q(x) − Q(up(y))) / τ)`` with ``Q`` that reward's score.
* **input quality** ``q(y) = (1 − blur(y)) · exp(−σ̂(y) / noise_scale)`` in [0, 1], from the LR image
  alone: ``blur`` is Crété-Roffet's no-reference blur estimate (how little a 5-tap box blur changes the
  luma's neighbour differences; 0 sharp, 1 flat), ``σ̂`` Immerkær's fast noise estimate of the luma.
* **trade-off** ``w = w_low + (w_high − w_low)·q`` (``fidelity_weight_low/high``), monotone in ``q``:
  a clean input is to be kept (weight on fidelity), a poor one to be improved (weight on gain).

``compass = w·F + (1 − w)·G``. ``compass_fr`` adds the HR reference ``z`` (``metadata["reference"]``, an
image, or the ``sr`` benchmark's ``metadata["task"]`` rendered at the output size):
``FR = ½·SSIM(x, z) + ½·min(PSNR(x, z) / psnr_max, 1)`` and ``compass_fr = (1 − λ)·compass + λ·FR``
(``λ`` = ``reference_weight``). No LPIPS: the ``lpips`` pip package ships only its linear heads, its
ImageNet backbones are downloaded by torchvision on first use.

The LR input is ``metadata[i]["image"]`` (a path, PIL image, tensor or a callable rendering one), the same
conditioning image the policy was given. Each reward returns one component (its name); ``info`` holds the
parts (``fidelity``, ``gain``, ``input_quality``, ``fidelity_weight``, and ``psnr`` / ``ssim`` for FR).
Known limit of the weight-free gain: added high-frequency noise raises the Laplacian energy too; ``τ``
saturates the gain and fidelity (and, in the full-reference stage, PSNR/SSIM) hold it in check.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from flowalign.errors import UserError
from flowalign.protocols import RewardOutput
from rewards.common import check_images, check_lengths, constant, finite_mask
from rewards.registry import register

LUMA = (0.299, 0.587, 0.114)
EPS = 1e-6


def luma(x: torch.Tensor) -> torch.Tensor:
    """``(B, 3, H, W)`` → ``(B, 1, H, W)`` Rec. 601 luma."""
    w = constant(LUMA, x).view(1, 3, 1, 1)
    return (x * w).sum(1, keepdim=True)


def resize(x: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """Bicubic resize of ``(B, C, H, W)`` to ``size``, antialiased when shrinking, clamped to [0, 1]."""
    if tuple(x.shape[-2:]) == tuple(size):
        return x
    shrink = size[0] < x.shape[-2] or size[1] < x.shape[-1]
    return F.interpolate(x, size=size, mode="bicubic", align_corners=False, antialias=shrink).clamp(0, 1)


def _gaussian_window(sigma: float, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    radius = max(1, int(round(3 * sigma)))
    t = torch.arange(-radius, radius + 1, device=device, dtype=dtype)
    g = torch.exp(-(t**2) / (2 * sigma**2))
    return g / g.sum()


def _blur(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Separable per-channel filter of ``(B, C, H, W)`` with the 1-D kernel ``g`` (reflect padding)."""
    c, r = x.shape[1], g.numel() // 2
    r_h, r_w = min(r, x.shape[-2] - 1), min(r, x.shape[-1] - 1)
    gh = g[r - r_h : r + r_h + 1].view(1, 1, -1, 1).repeat(c, 1, 1, 1)
    gw = g[r - r_w : r + r_w + 1].view(1, 1, 1, -1).repeat(c, 1, 1, 1)
    x = F.conv2d(F.pad(x, (0, 0, r_h, r_h), mode="reflect"), gh / gh.sum((-2, -1), keepdim=True), groups=c)
    return F.conv2d(F.pad(x, (r_w, r_w, 0, 0), mode="reflect"), gw / gw.sum((-2, -1), keepdim=True), groups=c)


def ssim(a: torch.Tensor, b: torch.Tensor, sigma: float = 1.5) -> torch.Tensor:
    """Mean SSIM ``(B,)`` of images ``(B, C, H, W)`` in [0, 1] (Gaussian window, per channel, then averaged)."""
    g = _gaussian_window(sigma, a.device, a.dtype)
    c1, c2 = 0.01**2, 0.03**2
    mu_a, mu_b = _blur(a, g), _blur(b, g)
    var_a = _blur(a * a, g) - mu_a**2
    var_b = _blur(b * b, g) - mu_b**2
    cov = _blur(a * b, g) - mu_a * mu_b
    s = ((2 * mu_a * mu_b + c1) * (2 * cov + c2)) / ((mu_a**2 + mu_b**2 + c1) * (var_a + var_b + c2))
    return s.flatten(1).mean(1)


def psnr(a: torch.Tensor, b: torch.Tensor, cap: float = 100.0) -> torch.Tensor:
    """PSNR in dB ``(B,)`` of images in [0, 1], capped at ``cap`` (identical images)."""
    mse = (a - b).pow(2).flatten(1).mean(1)
    return (10 * torch.log10(1.0 / mse.clamp(min=10 ** (-cap / 10)))).clamp(max=cap)


def laplacian_energy(x: torch.Tensor) -> torch.Tensor:
    """``mean((∇² luma)²)`` ``(B,)`` of ``(B, 3, H, W)``: the no-weights sharpness measure (valid region)."""
    k = constant([[0.0, 1.0, 0.0], [1.0, -4.0, 1.0], [0.0, 1.0, 0.0]], x)
    return F.conv2d(luma(x), k.view(1, 1, 3, 3)).pow(2).flatten(1).mean(1)


def blur_estimate(y: torch.Tensor, taps: int = 5) -> torch.Tensor:
    """Crété-Roffet no-reference blur ``(B,)`` in [0, 1] (0 sharp, 1 nothing left to blur) of ``(B, 3, h, w)``:
    the share of the luma's neighbour differences that a ``taps``-wide box blur leaves, the larger of the
    vertical and horizontal estimates."""
    f = luma(y)
    out = []
    for dim in (-2, -1):
        pad = (0, 0, taps // 2, taps // 2) if dim == -2 else (taps // 2, taps // 2, 0, 0)
        shape = (1, 1, taps, 1) if dim == -2 else (1, 1, 1, taps)
        b = F.conv2d(F.pad(f, pad, mode="replicate"), torch.full(shape, 1.0 / taps, dtype=f.dtype, device=f.device))
        d_f, d_b = f.diff(dim=dim).abs(), b.diff(dim=dim).abs()
        s_f = d_f.flatten(1).sum(1)
        s_v = (d_f - d_b).clamp(min=0).flatten(1).sum(1)
        out.append(torch.where(s_f > EPS, (s_f - s_v) / s_f.clamp(min=EPS), torch.ones_like(s_f)))
    return torch.maximum(*out).clamp(0, 1)


def noise_estimate(y: torch.Tensor) -> torch.Tensor:
    """Immerkær's fast noise standard deviation ``(B,)`` of the luma of ``(B, 3, h, w)`` (in [0, 1] units)."""
    k = constant([[1.0, -2.0, 1.0], [-2.0, 4.0, -2.0], [1.0, -2.0, 1.0]], y)
    r = F.conv2d(luma(y), k.view(1, 1, 3, 3)).abs().flatten(1).mean(1)
    return math.sqrt(math.pi / 2) * r / 6


def input_quality(y: torch.Tensor, noise_scale: float = 0.05) -> torch.Tensor:
    """``q(y) = (1 − blur(y))·exp(−σ̂(y) / noise_scale)`` ``(B,)`` in [0, 1] of LR images ``(B, 3, h, w)``."""
    return (1 - blur_estimate(y)) * torch.exp(-noise_estimate(y) / noise_scale)


def fidelity_weight(q: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """The trade-off ``w = low + (high − low)·q``: the weight of fidelity (``1 − w`` that of gain)."""
    return low + (high - low) * q.clamp(0, 1)


def _in_range(who: str, name: str, value: float, lo: float, hi: float) -> float:
    if not lo <= float(value) <= hi:
        raise UserError(f"{who} reward: {name}={value} must lie in [{lo}, {hi}]")
    return float(value)


def _lr_images(metadata: list[dict[str, Any]], who: str) -> list[torch.Tensor]:
    from flowalign.sampling.inputs import load_input_image

    images = []
    for i, m in enumerate(metadata):
        if not m or m.get("image") is None:
            raise UserError(f"{who} reward scores an LR → SR transition: metadata[{i}] needs the LR input as 'image' "
                            "(use data.bench: sr, or a JSONL with an image per prompt)")
        images.append(load_input_image(m["image"]))
    return images


@register("compass")
class Compass:
    """``w(q)·fidelity + (1 − w(q))·gain`` of each SR sample against its LR input (see the module docstring).

    Options: ``fidelity_weight_low`` / ``fidelity_weight_high`` (the fidelity weight for the poorest / the
    cleanest input), ``gain_temperature`` (τ), ``noise_scale`` (σ̂ at which the noise factor of ``q`` is 1/e),
    ``path`` (a no-reference quality model's weights; None: Laplacian energy), ``quality_model`` (the reward
    that reads ``path``, default ``aesthetic``; without ``path`` it is used as it loads by itself) and
    ``quality_options`` (more options for it).
    """

    name = "compass"
    differentiable = False

    def __init__(self, fidelity_weight_low: float = 0.3, fidelity_weight_high: float = 0.9,
                 gain_temperature: float = 1.0, noise_scale: float = 0.05, path: str | None = None,
                 quality_model: str | None = None, quality_options: dict[str, Any] | None = None):
        who = self.name
        self.w_low = _in_range(who, "fidelity_weight_low", fidelity_weight_low, 0, 1)
        self.w_high = _in_range(who, "fidelity_weight_high", fidelity_weight_high, 0, 1)
        if self.w_low > self.w_high:
            raise UserError(f"{who} reward: fidelity_weight_low={fidelity_weight_low} must not exceed "
                            f"fidelity_weight_high={fidelity_weight_high} (a clean input weighs fidelity more)")
        self.tau = _in_range(who, "gain_temperature", gain_temperature, 1e-3, 100)
        self.noise_scale = _in_range(who, "noise_scale", noise_scale, 1e-4, 1)
        self.quality = None
        if path is not None or quality_model is not None:
            from rewards.registry import load

            options = dict(quality_options or {})
            if path is not None:
                options["path"] = path
            self.quality = load(quality_model or "aesthetic", **options)

    @classmethod
    def planned_bytes(cls, options: dict[str, Any]) -> int:
        """The quality model's size where one is read (``path`` or ``quality_model``), else nothing. It scores
        the images on the CPU (``__call__`` moves them there), so it holds the accelerator only where
        ``quality_options`` give it a device there."""
        if options.get("path") is None and options.get("quality_model") is None:
            return 0
        from rewards.registry import planned_bytes

        quality = {"device": "cpu", **dict(options.get("quality_options") or {})}
        if options.get("path") is not None:
            quality["path"] = options["path"]
        return planned_bytes(options.get("quality_model") or "aesthetic", quality)

    def quality_score(self, images: torch.Tensor) -> torch.Tensor:
        """``Q`` ``(B,)`` of images ``(B, 3, H, W)``: the quality model's total, or Laplacian energy."""
        if self.quality is None:
            return laplacian_energy(images)
        out = self.quality(images, [""] * len(images), [{} for _ in range(len(images))])
        return out.total.detach().float().cpu()

    def parts(self, x: torch.Tensor, lr: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """Fidelity, gain, input quality, weight and score ``(B,)`` of outputs ``x (B, 3, H, W)`` for LR inputs."""
        size = tuple(x.shape[-2:])
        fidelity, up, q = [], [], []
        for xi, yi in zip(x, lr):
            y = yi[None].to(x)
            fidelity.append(ssim(resize(xi[None], tuple(y.shape[-2:])), y))
            up.append(resize(y, size))
            q.append(input_quality(y, self.noise_scale))
        up_t = torch.cat(up)
        q_sr, q_up = self.quality_score(x), self.quality_score(up_t)
        if self.quality is None:
            gain = torch.tanh(torch.log((q_sr + EPS) / (q_up + EPS)) / self.tau)
        else:
            gain = torch.tanh((q_sr - q_up) / self.tau)
        q_t = torch.cat(q)
        w = fidelity_weight(q_t, self.w_low, self.w_high)
        fid = torch.cat(fidelity)
        return {"fidelity": fid, "gain": gain, "input_quality": q_t, "fidelity_weight": w,
                "compass": w * fid + (1 - w) * gain}

    def score(self, x: torch.Tensor, prompts: list[str], metadata: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        return self.parts(x, _lr_images(metadata, self.name))

    def __call__(self, samples: torch.Tensor, prompts: list[str], metadata: list[dict[str, Any]]) -> RewardOutput:
        """``samples`` ``(B, 3, H, W)`` in [0, 1] → ``{name: (B,)}``; a non-finite sample is masked."""
        check_images(samples, self.name)
        check_lengths(samples.shape[0], prompts, metadata, self.name)
        valid = finite_mask(samples).cpu()
        x = samples.detach().float().cpu().nan_to_num(0.0).clamp(0, 1)
        with torch.no_grad():
            parts = self.score(x, prompts, metadata)
        info = [{k: float(v[i]) for k, v in parts.items()} for i in range(len(x))]
        return RewardOutput({self.name: parts[self.name].float()}, valid=valid, info=info)


@register("compass_fr")
class CompassFR(Compass):
    """``(1 − λ)·compass + λ·(½·SSIM(x, HR) + ½·min(PSNR(x, HR)/psnr_max, 1))``: the full-reference stage's
    reward. The HR image: ``metadata["reference"]`` (an image) or the ``sr`` task in ``metadata["task"]``
    rendered at the output size. Options: those of ``compass``, ``reference_weight`` (λ) and ``psnr_max`` (dB)."""

    name = "compass_fr"

    def __init__(self, reference_weight: float = 0.5, psnr_max: float = 40.0, **options: Any):
        super().__init__(**options)
        self.reference_weight = _in_range(self.name, "reference_weight", reference_weight, 0, 1)
        self.psnr_max = _in_range(self.name, "psnr_max", psnr_max, 1, 100)

    def reference(self, metadata: list[dict[str, Any]], size: tuple[int, int]) -> torch.Tensor:
        """The HR references ``(B, 3, H, W)`` at the outputs' size."""
        from flowalign.sampling.inputs import load_input_image

        refs = []
        for i, m in enumerate(metadata):
            if m and m.get("reference") is not None:
                refs.append(resize(load_input_image(m["reference"])[None], size))
            elif m and m.get("task") is not None:
                from rewards.sr import render_hr

                if size[0] != size[1]:
                    raise UserError(f"{self.name} reward: sr scenes are square, but the outputs are {size[0]}x{size[1]}")
                refs.append(load_input_image(render_hr(m["task"], size[0]))[None])
            else:
                raise UserError(f"{self.name} reward needs the HR image: metadata[{i}] has no 'reference' image and "
                                "no sr 'task' (use data.bench: sr, or compass for reference-free scoring)")
        return torch.cat(refs)

    def score(self, x: torch.Tensor, prompts: list[str], metadata: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        parts = super().score(x, prompts, metadata)
        hr = self.reference(metadata, tuple(x.shape[-2:])).to(x)
        s, p = ssim(x, hr), psnr(x, hr)
        full_reference = 0.5 * s + 0.5 * (p / self.psnr_max).clamp(max=1)
        lam = self.reference_weight
        return {**parts, "ssim": s, "psnr": p, "full_reference": full_reference,
                "compass_fr": (1 - lam) * parts["compass"] + lam * full_reference}
