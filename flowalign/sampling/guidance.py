"""RGS: reward-guided sampling with a latent reward, no training (``docs/methods/latent_registers.md``).

Guanys-dar/latent-reward-register's step (``guidance.py`` @ c22b65e, ``RewardGradientGuidance.correction``),
written on the velocity. Each guided step adds to the sampler's own next state

    Δ = x_next − x = (σ' − σ)·v       c = s·rms(Δ)·g/rms(g)       x_next ← x_next + c

with ``g = ∇_x r_ψ(x_σ, σ, c)``, ``c`` dropped for a sample whose ``rms(g) ≤ 1e-6`` and clipped to
``2·s·rms(Δ)`` (rms per sample over every element). Because ``σ' < σ``, that is the velocity
``v_c = v − s·rms(v)·g/rms(g)`` (:func:`guide_velocity`): moving toward data goes along −v, so subtracting
``g`` climbs the reward, ``‖v_c − v‖ = s‖v‖`` per sample, and s = 0 returns ``v`` itself (plain sampling bit
for bit). An optional σ window ``(σ_lo, σ_hi)`` guides only the steps whose σ lies inside it; or the authors'
σ bands (their ``GuidanceSchedule``): ``((threshold, s), ...)`` with thresholds high to low, a step at σ
taking the ``s`` of the first band with ``σ > threshold`` and no guidance below the last (their SD3 preset:
``((0.8, 0.30), (0.2, 0.05))``).

The reward is anything with the :class:`~flowalign.protocols.LatentReward` protocol; this core module
never imports a concrete reward. :func:`load_latent_reward` finds one from its folder's ``config.json``
(``"class": "package.module:Class"`` with a ``load(folder, ...)`` classmethod).
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from flowalign.errors import UserError
from flowalign.protocols import Conditioning, LatentReward

#: a sample whose reward gradient has rms at most this gets no correction (the authors' ``min_gradient_rms``)
MIN_GRADIENT_RMS = 1e-6
#: the correction's rms is clipped to this times ``s·rms(base)`` (the authors' ``max_scale_factor``)
MAX_SCALE_FACTOR = 2.0


def _work_dtype(t: torch.Tensor) -> torch.dtype:
    """float32, or float64 when given float64 (the known-answer tests run in float64)."""
    return torch.promote_types(t.dtype, torch.float32)


def reward_gradient(reward: LatentReward, x: torch.Tensor, sigma: float | torch.Tensor, cond: Conditioning
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(∇_x r(x, σ, c), r)``: ``(B, ...)`` and ``(B,)``, float32 (float64 for float64 ``x``); gradient with
    respect to the input only (the register's ``score_and_grad``: autograd of ``r.sum()``)."""
    dtype = _work_dtype(x)
    with torch.enable_grad():
        x_in = x.detach().to(dtype).requires_grad_(True)
        score = reward.score(x_in, sigma, cond)
        (grad,) = torch.autograd.grad(score.sum(), x_in)
    return grad.to(dtype), score.detach().to(dtype)


def head_gradients(reward: Any, x: torch.Tensor, sigma: float | torch.Tensor, cond: Conditioning,
                   heads: Sequence[str]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``({h: ∇_x r_h}, {h: r_h})`` of the named heads of a several-head latent reward (its ``score_heads``),
    from one pass: the authors' ``score_and_grad`` (autograd of each head's summed score, the graph kept
    between heads). Gradients ``(B, ...)`` and scores ``(B,)``, float32 (float64 for float64 ``x``)."""
    score_heads = getattr(reward, "score_heads", None)
    if score_heads is None:
        raise UserError(f"reward heads {list(heads)}: this latent reward has one score and no named heads; "
                        "drop the heads option")
    dtype = _work_dtype(x)
    with torch.enable_grad():
        x_in = x.detach().to(dtype).requires_grad_(True)
        scores = score_heads(x_in, sigma, cond)
        unknown = [h for h in heads if h not in scores]
        if unknown:
            raise UserError(f"reward heads {unknown}: the latent reward's heads are {', '.join(scores)}")
        grads = {}
        for i, h in enumerate(heads):
            (grads[h],) = torch.autograd.grad(scores[h].sum(), x_in, retain_graph=i + 1 < len(heads))
    return {h: g.to(dtype) for h, g in grads.items()}, {h: scores[h].detach().to(dtype) for h in heads}


def per_sample_rms(t: torch.Tensor) -> torch.Tensor:
    """``(B,)``: the root mean square of each sample of ``t`` ``(B, ...)``."""
    return t.square().reshape(t.shape[0], -1).mean(dim=1).sqrt()


def unit_rms(t: torch.Tensor, eps: float = 1e-12) -> torch.Tensor:
    """``t / rms(t)`` per sample, ``(B, ...)``: the authors' per-head normalisation (``combine``) of a reward
    gradient before the correction (so their ``min_gradient_rms`` gate acts only on an all-but-zero
    gradient, ``rms(g) < 1e-12``)."""
    return t / per_sample_rms(t).clamp_min(eps).view(t.shape[0], *([1] * (t.ndim - 1)))


def combine_heads(gradients: torch.Tensor | Mapping[str, torch.Tensor], weights: Mapping[str, float] | None = None,
                  eps: float = 1e-12) -> torch.Tensor:
    """``Σ_h w_h·g_h/rms(g_h)`` per sample, ``(B, ...)``: the authors' ``combine`` (each head's gradient
    normalised, weighted, summed; ``w`` 1 where not given). A single tensor is one head: ``g/rms(g)``."""
    if isinstance(gradients, torch.Tensor):
        return unit_rms(gradients, eps)
    if not gradients:
        raise ValueError("combine_heads: no head gradients given")
    weights = weights or {}
    return sum(unit_rms(g, eps) * float(weights.get(h, 1.0)) for h, g in gradients.items())


def guiding_gradient(reward: Any, x: torch.Tensor, sigma: float | torch.Tensor, cond: Conditioning,
                     heads: Sequence[str] | None = None, weights: Mapping[str, float] | None = None
                     ) -> tuple[torch.Tensor | dict[str, torch.Tensor], torch.Tensor]:
    """What a guided step follows, and the score ``(B,)``: the reward's gradient (``heads`` None: its
    ``score``), or the named heads' gradients as a dict (for :func:`combine_heads`), the score the first's."""
    if heads is None:
        return reward_gradient(reward, x, sigma, cond)
    grads, scores = head_gradients(reward, x, sigma, cond, heads)
    return grads, scores[heads[0]]


def reward_correction(base: torch.Tensor, grad: torch.Tensor, scale: float, eps: float = 1e-12) -> torch.Tensor:
    """``s·rms(base)·g/rms(g)`` per sample, ``(B, ...)``: zero for a sample with ``rms(g) ≤ 1e-6``, its rms
    clipped to ``2·s·rms(base)`` (the authors' ``correction``, ``base`` standing for their ``base_next − x``:
    the correction is the same whether ``base`` is that step or its velocity, up to the step's sign).
    ``grad``: the combined gradient (:func:`unit_rms` of the reward's)."""
    dtype = _work_dtype(base)
    base, grad = base.to(dtype), grad.to(dtype)
    shape = (base.shape[0], *([1] * (base.ndim - 1)))
    base_rms = per_sample_rms(base).clamp_min(eps)
    grad_rms = per_sample_rms(grad)
    applied = (grad_rms > MIN_GRADIENT_RMS).to(dtype)
    correction = grad / grad_rms.clamp_min(eps).view(shape) * (scale * base_rms * applied).view(shape)
    maximum = MAX_SCALE_FACTOR * scale * base_rms
    clip = torch.minimum(torch.ones_like(base_rms), maximum / per_sample_rms(correction).clamp_min(eps))
    return correction * clip.view(shape)


def guide_velocity(v: torch.Tensor, grad: torch.Tensor | Mapping[str, torch.Tensor], scale: float,
                   eps: float = 1e-12, weights: Mapping[str, float] | None = None) -> torch.Tensor:
    """``v − s·rms(v)·ĝ/rms(ĝ)`` per sample, ``ĝ`` the :func:`combine_heads` of ``grad`` (one gradient, or a
    dict by head with ``weights``), as the authors' teacher combines its heads, then :func:`reward_correction`;
    ``(B, ...)``; ``v`` unchanged (the same tensor) when s = 0. With ``Δ = (σ' − σ)·v``, ``x + (σ' − σ)·v_c``
    is the authors' ``x + Δ + c(Δ)``."""
    if scale == 0:
        return v
    dtype = _work_dtype(v)
    grads = (grad.to(v.device, dtype) if isinstance(grad, torch.Tensor)
             else {h: g.to(v.device, dtype) for h, g in grad.items()})
    return v.to(dtype) - reward_correction(v, combine_heads(grads, weights, eps), scale, eps)


@dataclass
class Guidance:
    """A reward-guided velocity: ``guidance(v, x, σ, cond) -> v_c``. ``window = (σ_lo, σ_hi)`` limits the
    guided steps to σ in that closed range (None: every step). ``bands`` (the authors' schedule, replacing
    ``scale`` and ``window``): ``((threshold, s), ...)``, thresholds strictly decreasing in [0, 1]; the scale at
    σ is the ``s`` of the first band with ``σ > threshold``, 0 below the last."""

    reward: LatentReward
    scale: float = 0.0
    window: tuple[float, float] | None = None
    bands: tuple[tuple[float, float], ...] | None = None
    #: the reward's heads to follow, each gradient normalised then weighted (``head_weights``, default 1) and
    #: summed (the authors' ``combine``); None: the reward's ``score``
    heads: tuple[str, ...] | None = None
    head_weights: dict[str, float] | None = None

    def __post_init__(self) -> None:
        if self.scale < 0:
            raise UserError(f"guide scale κ={self.scale} must be >= 0 (0 reproduces plain sampling)")
        if self.window is not None:
            lo, hi = (float(w) for w in self.window)
            if not 0 <= lo <= hi <= 1:
                raise UserError(f"guide window {self.window}: give (σ_lo, σ_hi) with 0 <= σ_lo <= σ_hi <= 1")
            self.window = (lo, hi)
        if self.bands is not None:
            bands = tuple((float(t), float(s)) for t, s in self.bands)
            thresholds = [t for t, _ in bands]
            if not bands or self.window is not None:
                raise UserError("guide bands: give at least one (threshold, scale) band, and no window beside them")
            if thresholds != sorted(set(thresholds), reverse=True) or not all(0 <= t <= 1 for t in thresholds):
                raise UserError(f"guide bands {list(bands)}: thresholds must be in [0, 1] and strictly decreasing "
                                "(e.g. 0.8:0.30 0.2:0.05)")
            if any(s < 0 for _, s in bands):
                raise UserError(f"guide bands {list(bands)}: every scale must be >= 0")
            self.bands = bands

    def scale_at(self, sigma: float) -> float:
        """The scale of the step at ``σ``: the band's (the authors' ``GuidanceSchedule.at``), or ``scale`` inside
        the window, else 0."""
        if self.bands is not None:
            return next((s for threshold, s in self.bands if float(sigma) > threshold), 0.0)
        inside = self.window is None or self.window[0] <= float(sigma) <= self.window[1]
        return self.scale if inside else 0.0

    def active(self, sigma: float) -> bool:
        return self.scale_at(sigma) > 0

    def __call__(self, v: torch.Tensor, x: torch.Tensor, sigma: float, cond: Conditioning) -> torch.Tensor:
        scale = self.scale_at(sigma)
        if scale == 0:
            return v
        grad, _ = guiding_gradient(self.reward, x, sigma, cond, self.heads, self.head_weights)
        return guide_velocity(v, grad, scale, weights=self.head_weights)


class GuidedPolicy:
    """A policy whose ``velocity`` is the guided one: any sampler or evaluation loop samples with RGS
    unchanged. Everything else is delegated to the wrapped policy."""

    def __init__(self, policy: Any, guidance: Guidance):
        self.policy, self.guidance = policy, guidance

    def velocity(self, x: torch.Tensor, sigma: float | torch.Tensor, cond: Conditioning, guidance: float) -> torch.Tensor:
        v = self.policy.velocity(x, sigma, cond, guidance)
        return self.guidance(v, x, float(torch.as_tensor(sigma).flatten()[0]), cond)

    def adapter_disabled(self) -> AbstractContextManager[None]:
        return self.policy.adapter_disabled()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.policy, name)


#: the class that reads a folder in the Latent Reward Registers authors' own checkpoint layout
AUTHORS_REGISTER_CLASS = ("rewards.latent_registers.grid", "GridReward")


def load_latent_reward(folder: str | Path, **kwargs: Any) -> Any:
    """The latent reward saved in ``folder`` (its ``config.json`` names the class that reads it)."""
    reward = latent_reward_class(folder).load(Path(folder), **kwargs)
    if not isinstance(reward, LatentReward):
        raise UserError(f"the latent reward loaded from {folder} has no score(x, sigma, cond) method")
    return reward


def latent_reward_sizes(folder: str | Path) -> dict[str, int]:
    """What loading the latent reward of ``folder`` allocates, read without loading it: ``own`` parameters of
    its own network, ``model`` whole transformers it loads beside the policy's (its class's ``sizes(folder)``;
    none known: both 0)."""
    sizes = getattr(latent_reward_class(folder), "sizes", None)
    return dict(sizes(Path(folder))) if sizes is not None else {"own": 0, "model": 0}


def latent_reward_class(folder: str | Path) -> type:
    """The class ``folder``'s ``config.json`` names for its latent reward."""
    folder = Path(folder)
    config = folder / "config.json"
    if not config.is_file() and (folder / "manifest.json").is_file():
        # the Latent Reward Registers authors' checkpoint layout (register.safetensors, config.yaml, manifest.json)
        return getattr(importlib.import_module(AUTHORS_REGISTER_CLASS[0]), AUTHORS_REGISTER_CLASS[1])
    if not config.is_file():
        raise UserError(f"{folder} is not a latent reward folder (no config.json); train one with `flowalign train-reward`")
    try:
        target = json.loads(config.read_text()).get("class", "")
    except json.JSONDecodeError as err:
        raise UserError(f"{config} is not valid JSON ({err})") from err
    module, _, attr = str(target).partition(":")
    if not module or not attr:
        raise UserError(f"{config}: 'class' must name 'package.module:Class', got {target!r}")
    try:
        cls = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as err:
        raise UserError(f"{config}: cannot import {target!r} ({err})") from err
    return cls
