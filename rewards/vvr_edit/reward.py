"""The registered ``vvr_edit`` reward, its two parts as rewards of their own (``vvr_edit.instruction``,
``vvr_edit.preservation``), and the renderers of an edit task's source and reference result."""

from __future__ import annotations

from typing import Any, Mapping

import torch
from PIL import Image

from flowalign.errors import UserError
from flowalign.protocols import RewardOutput
from rewards.planning import holds_nothing
from rewards.registry import register
from rewards.vvr import render
from rewards.vvr.verify import GAMMA, score
from rewards.vvr_edit.tasks import EditTask, as_edit_task, scene_dict
from rewards.vvr_edit.verify import verify_edit

#: the checks that "everything not named stays" (docs/methods/vvr_edit.md); every other check is the instruction's
PRESERVATION_CHECKS = ("total_count", "keeps")


def render_source(task: EditTask | Mapping[str, Any], size: int = 64) -> Image.Image:
    """The scene to edit (the model's input image)."""
    task = as_edit_task(task)
    return render(scene_dict(task, task.objects), size=size)


def render_result(task: EditTask | Mapping[str, Any], size: int = 64) -> Image.Image:
    """The reference edited scene (one correct answer)."""
    task = as_edit_task(task)
    return render(scene_dict(task, task.result), size=size)


def render_target(metadata: Mapping[str, Any], size: int) -> Image.Image:
    """The reference result of a training draw (``metadata["task"]``): the image supervised fine-tuning on
    (source, instruction, result) triples trains toward, its source being ``metadata["image"]``."""
    if not metadata or "task" not in metadata:
        raise UserError("a vvr_edit training item has no 'task' in its metadata; draw tasks with data.bench: vvr_edit")
    return render_result(metadata["task"], size=size)


@register("vvr_edit")
class VVREditReward:
    """``R = (1-γ)·mean + γ·all`` over the instruction and keep checks of :func:`verify_edit`, per sample.

    ``metadata[i]["task"]`` holds sample ``i``'s edit task (an :class:`EditTask` or its dict); a sample
    without one, or with an unreadable image, is invalid (masked, the reason in ``info``).
    """

    name = "vvr_edit"
    differentiable = False
    #: a program, no model: nothing on the device (flowalign plan)
    planned_bytes = staticmethod(holds_nothing)
    #: which checks score: all (None), only the instruction's ("instruction") or only the preservation ones
    part: str | None = None

    def __init__(self, gamma: float = GAMMA):
        if not 0.0 <= gamma <= 1.0:
            raise UserError(f"vvr_edit reward: gamma must lie in [0, 1], got {gamma}")
        self.gamma = gamma

    def __call__(self, samples: torch.Tensor, prompts: list[str], metadata: list[dict[str, Any]]) -> RewardOutput:
        """``samples``: ``(B, 3, H, W)`` float in [0, 1] → components ``{"vvr_edit": (B,)}``, ``valid`` ``(B,)``."""
        if samples.ndim != 4 or samples.shape[1] != 3:
            raise UserError(f"vvr_edit scores images (B, 3, H, W); got samples of shape {tuple(samples.shape)}")
        n = samples.shape[0]
        finite = torch.isfinite(samples).flatten(1).all(1).tolist()
        pixels = (samples.detach().float().nan_to_num(0.0).clamp(0, 1) * 255).round().to(torch.uint8)
        pixels = pixels.permute(0, 2, 3, 1).cpu().numpy()
        scores, valid = torch.zeros(n), torch.zeros(n, dtype=torch.bool)
        info: list[dict[str, Any]] = []
        for i in range(n):
            task = metadata[i].get("task") if i < len(metadata) and metadata[i] else None
            if task is None or not finite[i]:
                reason = f"metadata[{i}] has no 'task'" if task is None else "image has NaN or infinite values"
                info.append({"constraints": [], "all_passed": False, "reason": reason})
                continue
            verdict = verify_edit(task, pixels[i])
            checks = self.scored(verdict.constraints)
            passed = [p for _, p in checks]
            info.append({"constraints": checks, "all_passed": verdict.valid and all(passed), "reason": verdict.reason})
            if verdict.valid:
                valid[i] = True
                scores[i] = score(passed, self.gamma)
        return RewardOutput(components={self.name: scores}, valid=valid, info=info)

    def scored(self, checks: list[tuple[str, bool]]) -> list[tuple[str, bool]]:
        """The ``(type, passed)`` checks of this reward's :attr:`part`."""
        if self.part is None:
            return checks
        return [c for c in checks if (c[0] in PRESERVATION_CHECKS) == (self.part == "preservation")]


@register("vvr_edit.instruction")
class VVREditInstruction(VVREditReward):
    """``vvr_edit`` over the instruction's own checks alone (recolour: the new colour exists, the old is absent;
    move / add: the relation (and the added object); remove: absent): did the edit happen."""

    name = "vvr_edit.instruction"
    part = "instruction"


@register("vvr_edit.preservation")
class VVREditPreservation(VVREditReward):
    """``vvr_edit`` over the preservation checks alone (``total_count`` and each untouched object's ``keeps``):
    did everything the instruction does not name stay as it was."""

    name = "vvr_edit.preservation"
    part = "preservation"
