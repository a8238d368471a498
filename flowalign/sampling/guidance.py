"""RGS: reward-guided sampling with a latent reward, no training (``docs/methods/latent_registers.md``) [derived].

Each step the velocity is bent against the reward gradient with its size tied to the velocity's own:

    g = ∇_x r_ψ(x_σ, σ, c)          v_c = v − κ·‖v‖·g/‖g‖          x ← x + (σ' − σ)·v_c

Moving toward data goes along −v, so subtracting ``g`` climbs the reward. ``‖v_c − v‖ = κ‖v‖`` exactly
(per sample), and κ = 0 returns ``v`` itself, so the sampler is reproduced bit for bit. An optional
σ window ``(σ_lo, σ_hi)`` guides only the steps whose σ lies inside it.

The reward is anything with the :class:`~flowalign.protocols.LatentReward` protocol; this core module
never imports a concrete reward. :func:`load_latent_reward` finds one from its folder's ``config.json``
(``"class": "package.module:Class"`` with a ``load(folder, ...)`` classmethod).
"""

from __future__ import annotations

import importlib
import json
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from flowalign.errors import UserError
from flowalign.protocols import Conditioning, LatentReward


def reward_gradient(reward: LatentReward, x: torch.Tensor, sigma: float | torch.Tensor, cond: Conditioning
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(∇_x r(x, σ, c), r)``: ``(B, ...)`` float32 and ``(B,)``; gradient w.r.t. the input only."""
    with torch.enable_grad():
        x_in = x.detach().float().requires_grad_(True)
        score = reward.score(x_in, sigma, cond)
        (grad,) = torch.autograd.grad(score.sum(), x_in)
    return grad.float(), score.detach().float()


def guide_velocity(v: torch.Tensor, grad: torch.Tensor, scale: float, eps: float = 1e-12) -> torch.Tensor:
    """``v − κ‖v‖·g/‖g‖`` per sample, ``(B, ...)``; ``v`` unchanged (the same tensor) when κ = 0."""
    if scale == 0:
        return v
    b = v.shape[0]
    v_norm = v.float().reshape(b, -1).norm(dim=1)
    g_norm = grad.float().reshape(b, -1).norm(dim=1).clamp_min(eps)
    factor = (scale * v_norm / g_norm).view(b, *([1] * (v.ndim - 1)))
    return v.float() - factor * grad.float()


@dataclass
class Guidance:
    """A reward-guided velocity: ``guidance(v, x, σ, cond) -> v_c``. ``window = (σ_lo, σ_hi)`` limits the
    guided steps to σ in that closed range (None: every step)."""

    reward: LatentReward
    scale: float
    window: tuple[float, float] | None = None

    def __post_init__(self) -> None:
        if self.scale < 0:
            raise UserError(f"guide scale κ={self.scale} must be >= 0 (0 reproduces plain sampling)")
        if self.window is not None:
            lo, hi = (float(w) for w in self.window)
            if not 0 <= lo <= hi <= 1:
                raise UserError(f"guide window {self.window}: give (σ_lo, σ_hi) with 0 <= σ_lo <= σ_hi <= 1")
            self.window = (lo, hi)

    def active(self, sigma: float) -> bool:
        if self.scale == 0:
            return False
        return self.window is None or self.window[0] <= float(sigma) <= self.window[1]

    def __call__(self, v: torch.Tensor, x: torch.Tensor, sigma: float, cond: Conditioning) -> torch.Tensor:
        if not self.active(sigma):
            return v
        grad, _ = reward_gradient(self.reward, x, sigma, cond)
        return guide_velocity(v, grad.to(v.device), self.scale)


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
