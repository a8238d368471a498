"""The registered rewards: ``motion_insight`` (the dimensions combined) and one reward per dimension.

``motion_insight.consistency``, ``motion_insight.continuity`` and ``motion_insight.plausibility`` are each
one dimension, so a GRPO run lists them as three rewards and ``advantage: gdpo`` normalises each within
its group before summing. They share one diagnosis per batch: the last few batches' diagnoses are kept,
keyed by the clips' bytes, so the three rewards of one step diagnose the batch once.

Every reward puts, in each sample's ``info``: ``scores`` (the three dimensions), ``causes`` (dimension →
cause, "" when none) and ``reason`` and ``note`` (the causes of its dimensions, "dimension: cause | ..."),
which the evaluation's results and galleries show beside the video (``reason`` when it is the
evaluation's reward, ``note`` through ``RewardScores.notes`` when it is one of its panel).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Any

import numpy as np
import torch

from flowalign.errors import UserError
from flowalign.protocols import RewardOutput
from rewards.motion_insight.diagnose import DIMENSIONS, Dimension, diagnose
from rewards.motion_insight.space import build
from rewards.planning import holds_nothing
from rewards.registry import register
from rewards.vvr_motion.video import batch_clips

COMBINES = ("mean", "product")
_CACHE_SIZE = 4
_cache: OrderedDict[bytes, list[dict[str, Dimension] | None]] = OrderedDict()


def _key(clips: np.ndarray, finite: list[bool], tasks: list[Any]) -> bytes:
    h = hashlib.blake2b(clips.tobytes(), digest_size=16)
    h.update(repr((clips.shape, finite, [repr(t) for t in tasks])).encode())
    return h.digest()


def _task(meta: Any, use_task: bool) -> Any:
    return meta.get("task") if use_task and isinstance(meta, dict) else None


def diagnose_batch(samples: torch.Tensor, metadata: list[dict[str, Any]], name: str,
                   use_task: bool = True) -> list[dict[str, Dimension] | None]:
    """``(B, F, 3, H, W)`` float in [0, 1] → each clip's dimensions (None: a non-finite clip)."""
    clips, finite = batch_clips(samples, name)
    tasks = [_task(m, use_task) for m in metadata]
    key = _key(clips, finite, tasks)
    if key in _cache:
        _cache.move_to_end(key)
        return _cache[key]
    out = [diagnose(build(clip, task)) if ok else None for clip, ok, task in zip(clips, finite, tasks)]
    _cache[key] = out
    while len(_cache) > _CACHE_SIZE:
        _cache.popitem(last=False)
    return out


def sample_info(dims: dict[str, Dimension] | None, only: tuple[str, ...] = DIMENSIONS) -> dict[str, Any]:
    """A sample's ``info``: scores and causes of every dimension, and ``reason`` from those of ``only``."""
    if dims is None:
        return {"reason": "video has NaN or infinite values"}
    causes = {k: d.cause for k, d in dims.items()}
    text = " | ".join(f"{k}: {causes[k]}" for k in only if causes[k])
    # "reason" reaches an evaluation's row when this is its reward, "note" when it is one of its panel
    return {"scores": {k: round(d.score, 4) for k, d in dims.items()}, "causes": causes, "reason": text, "note": text}


@register("motion_insight")
class MotionInsightReward:
    """Motion fidelity of each clip in [0, 1]: its three dimensions (``diagnose.py``) combined.

    ``combine``: ``mean`` (weighted by ``weights``, consistency / continuity / plausibility) or
    ``product`` (each dimension raised to its normalised weight: a weighted geometric mean, so one failed
    dimension fails the clip). ``use_task``: read the designated objects from ``metadata[i]["task"]`` when
    a sample has a motion task (else every object seen twice). A non-finite clip is invalid.
    """

    name = "motion_insight"
    differentiable = False
    #: a program, no model: nothing on the device (flowalign plan)
    planned_bytes = staticmethod(holds_nothing)

    def __init__(self, weights: list[float] | None = None, combine: str = "mean", use_task: bool = True):
        if combine not in COMBINES:
            raise UserError(f"motion_insight: combine={combine!r} is not one of {', '.join(COMBINES)}")
        w = [1.0, 1.0, 1.0] if weights is None else [float(x) for x in weights]
        if len(w) != 3 or any(not np.isfinite(x) or x < 0 for x in w) or sum(w) <= 0:
            raise UserError(f"motion_insight: weights={weights!r} must be three numbers >= 0 (consistency, "
                            "continuity, plausibility), not all 0")
        self.weights = np.array(w) / sum(w)
        self.combine, self.use_task = combine, use_task

    def _score(self, dims: dict[str, Dimension]) -> float:
        s = np.array([dims[k].score for k in DIMENSIONS])
        if self.combine == "mean":
            return float(s @ self.weights)
        return float(np.prod(np.maximum(s, 1e-12) ** self.weights))

    def __call__(self, samples: torch.Tensor, prompts: list[str], metadata: list[dict[str, Any]]) -> RewardOutput:
        """``samples`` ``(B, F, 3, H, W)`` float in [0, 1] → components ``{"motion_insight": (B,)}``."""
        diagnosed = diagnose_batch(samples, _metadata(metadata, len(samples)), self.name, self.use_task)
        scores = torch.tensor([self._score(d) if d is not None else 0.0 for d in diagnosed], dtype=torch.float32)
        valid = torch.tensor([d is not None for d in diagnosed], dtype=torch.bool)
        return RewardOutput({self.name: scores}, valid, [sample_info(d) for d in diagnosed])


class DimensionReward:
    """One dimension of ``motion_insight`` as a reward of its own (``dimension``: set by each subclass)."""

    dimension = ""
    differentiable = False
    #: a program, no model: nothing on the device (flowalign plan)
    planned_bytes = staticmethod(holds_nothing)

    def __init__(self, use_task: bool = True):
        self.name = f"motion_insight.{self.dimension}"
        self.use_task = use_task

    def __call__(self, samples: torch.Tensor, prompts: list[str], metadata: list[dict[str, Any]]) -> RewardOutput:
        """``samples`` ``(B, F, 3, H, W)`` float in [0, 1] → components ``{"motion_insight.<dimension>": (B,)}``."""
        diagnosed = diagnose_batch(samples, _metadata(metadata, len(samples)), self.name, self.use_task)
        scores = torch.tensor([d[self.dimension].score if d is not None else 0.0 for d in diagnosed],
                              dtype=torch.float32)
        valid = torch.tensor([d is not None for d in diagnosed], dtype=torch.bool)
        return RewardOutput({self.name: scores}, valid, [sample_info(d, (self.dimension,)) for d in diagnosed])


def _metadata(metadata: list[dict[str, Any]] | None, n: int) -> list[dict[str, Any]]:
    if metadata is None:
        return [{} for _ in range(n)]
    if len(metadata) != n:
        raise UserError(f"motion_insight: {len(metadata)} metadata entries for {n} samples; give one per sample")
    return metadata


def _register_dimension(dimension: str) -> None:
    cls = type(f"MotionInsight{dimension.title()}Reward", (DimensionReward,), {
        "dimension": dimension,
        "__doc__": f"The {dimension} dimension of ``motion_insight`` in [0, 1] (``diagnose.{dimension}``).",
    })
    register(f"motion_insight.{dimension}")(cls)


for _dimension in DIMENSIONS:
    _register_dimension(_dimension)
