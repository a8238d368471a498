"""The 8-bit images and clips of the reward known answers (``known_answers/flow_grpo_scorers.json``,
``imagereward_reference.json``, ``videoalign_reference.json``, ...): made from a seed by a fixed recipe, checked
against the SHA-256 of the bytes the reference scorers read."""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import torch


def recipe_image(seed: int, h: int, w: int) -> np.ndarray:
    """The known answers' image: 8-px cells of random colours (sharp edges, where kernels differ) plus
    per-pixel noise, kept inside [24, 231] so no resampling overshoot is clipped; uint8 ``(h, w, 3)``."""
    rng = np.random.default_rng(seed)
    cells = rng.integers(40, 216, size=(-(-h // 8), -(-w // 8), 3))
    base = np.repeat(np.repeat(cells, 8, 0), 8, 1)[:h, :w]
    noise = rng.integers(-16, 17, size=(h, w, 3))
    return np.clip(base + noise, 0, 255).astype(np.uint8)


def known_batch(spec: dict[str, Any]) -> tuple[torch.Tensor, list[str]]:
    """A known answers' batch (``shape``, ``seeds``, ``uint8_sha256``, ``prompts``) as ``(B, 3, h, w)`` floats
    ``uint8 / 255`` (what both sides were given) and its prompts."""
    h, w, _ = spec["shape"]
    arrays = [recipe_image(seed, h, w) for seed in spec["seeds"]]
    # the recipe must give the very bytes their scorers read
    assert [hashlib.sha256(a.tobytes()).hexdigest() for a in arrays] == spec["uint8_sha256"]
    return torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).float() / 255, spec["prompts"]


def recipe_clip(seed: int, frames: int, h: int, w: int) -> np.ndarray:
    """The known answers' clip: a pan across one wider :func:`recipe_image` (seed ``seed``), 3 px to the left a
    frame, so consecutive frames share content and move; uint8 ``(frames, h, w, 3)``."""
    wide = recipe_image(seed, h, w + 3 * (frames - 1))
    return np.stack([wide[:, 3 * f : 3 * f + w] for f in range(frames)])


def known_clips(spec: dict[str, Any]) -> tuple[torch.Tensor, list[str]]:
    """A known answers' batch of clips (``shape`` ``[F, h, w, 3]``, ``seeds``, ``uint8_sha256``, ``prompts``) as
    ``(B, F, 3, h, w)`` floats ``uint8 / 255`` and its prompts."""
    frames, h, w, _ = spec["shape"]
    arrays = [recipe_clip(seed, frames, h, w) for seed in spec["seeds"]]
    assert [hashlib.sha256(a.tobytes()).hexdigest() for a in arrays] == spec["uint8_sha256"]
    return torch.from_numpy(np.stack(arrays)).permute(0, 1, 4, 2, 3).float() / 255, spec["prompts"]
