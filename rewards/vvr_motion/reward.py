"""The registered video rewards: ``vvr_motion`` (verify each clip against its motion task) and
``temporal_consistency`` (object identity stability, no task)."""

from __future__ import annotations

from typing import Any

import torch

from flowalign.protocols import RewardOutput
from rewards.planning import holds_nothing
from rewards.registry import register
from rewards.vvr.reward import checked_gamma, tasks_to_score, verdict_score
from rewards.vvr.verify import GAMMA
from rewards.vvr_motion.consistency import temporal_consistency
from rewards.vvr_motion.graded import graded_credits
from rewards.vvr_motion.tasks import as_task
from rewards.vvr_motion.verify import verify
from rewards.vvr_motion.video import batch_clips


@register("vvr_motion")
class VVRMotionReward:
    """Deterministic motion reward ``R = (1-γ)·mean_j s_j + γ·Π_j s_j`` per clip; with ``partial_credit``
    a failed constraint's ``s_j`` is its graded credit in [0, 1) (``graded.py``) instead of 0.

    ``metadata[i]["task"]`` holds sample ``i``'s :class:`~rewards.vvr_motion.MotionTask` (or its dict).
    A sample without a task, or whose clip cannot be read (blank, non-finite, wrong frame count), is
    invalid: masked, with the reason in ``info``. ``info[i]["tracks"]`` lists each named object's track
    (found per frame, centres, areas). A malformed task raises ``ValueError``.
    """

    name = "vvr_motion"
    #: per-prompt metadata this reward scores against (checked before any sampling)
    requires_metadata = ("task",)
    differentiable = False
    #: a program, no model: nothing on the device (flowalign plan)
    planned_bytes = staticmethod(holds_nothing)

    def __init__(self, gamma: float = GAMMA, partial_credit: bool = False):
        self.gamma = checked_gamma(gamma, self.name)
        #: a failed constraint earns its graded credit (``graded.py``: presence × how far and how steadily
        #: it went) instead of 0, so "moved the right way, not far enough" ranks above "did not move". A
        #: training signal only: ``all_passed`` and benchmark accuracy are unchanged.
        self.partial_credit = partial_credit

    def __call__(self, samples: torch.Tensor, prompts: list[str], metadata: list[dict[str, Any]]) -> RewardOutput:
        """``samples``: ``(B, F, 3, H, W)`` float in [0, 1] → components ``{"vvr_motion": (B,)}``, ``valid`` ``(B,)``."""
        clips, finite = batch_clips(samples, self.name)
        n = len(clips)
        scores = torch.zeros(n, dtype=torch.float32)
        valid = torch.zeros(n, dtype=torch.bool)
        info: list[dict[str, Any]] = []
        for i, task in tasks_to_score(metadata, finite, "video", info):
            verdict = verify(task, clips[i])
            # tracks: where each named object was found per frame, so a per-clip verdict says why it failed
            info.append({"constraints": verdict.constraints, "all_passed": verdict.all_passed, "reason": verdict.reason,
                         "tracks": verdict.detected})
            if verdict.valid:
                valid[i] = True
                passed = [p for _, p in verdict.constraints]
                credits = graded_credits(as_task(task).constraints, passed, verdict.detected) if self.partial_credit \
                    else None
                scores[i] = verdict_score(passed, verdict.all_passed, self.gamma, credits)
        return RewardOutput(components={"vvr_motion": scores}, valid=valid, info=info)


@register("temporal_consistency")
class TemporalConsistencyReward:
    """Frame-to-frame stability of object identity in [0, 1] (``consistency.temporal_consistency``).

    Needs no task; a clip that cannot be read (blank, non-finite, a single frame) is invalid, with the
    reason and the per-pair scores in ``info``.
    """

    name = "temporal_consistency"
    differentiable = False
    #: a program, no model: nothing on the device (flowalign plan)
    planned_bytes = staticmethod(holds_nothing)

    def __call__(self, samples: torch.Tensor, prompts: list[str], metadata: list[dict[str, Any]]) -> RewardOutput:
        """``samples``: ``(B, F, 3, H, W)`` float in [0, 1] → components ``{"temporal_consistency": (B,)}``."""
        clips, finite = batch_clips(samples, self.name)
        scores = torch.zeros(len(clips), dtype=torch.float32)
        valid = torch.zeros(len(clips), dtype=torch.bool)
        info: list[dict[str, Any]] = []
        for i, clip in enumerate(clips):
            if not finite[i]:
                info.append({"pairs": [], "reason": "video has NaN or infinite values"})
                continue
            result = temporal_consistency(clip)
            info.append({"pairs": [round(p, 4) for p in result.pairs], "reason": result.reason})
            valid[i], scores[i] = result.valid, result.score
        return RewardOutput(components={"temporal_consistency": scores}, valid=valid, info=info)
