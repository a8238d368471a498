"""The registered ``vvr`` reward: verify each sample against the VVR task in its metadata."""

from __future__ import annotations

from typing import Any, Iterator

import torch

from flowalign.errors import UserError
from flowalign.protocols import RewardOutput
from rewards.planning import holds_nothing
from rewards.registry import register
from rewards.vvr.tasks import as_task
from rewards.vvr.verify import GAMMA, matches, score, verify


@register("vvr")
class VVRReward:
    """Deterministic VVR reward ``R = (1-γ)·mean_j s_j + γ·Π_j s_j`` per sample.

    ``metadata[i]["task"]`` holds sample ``i``'s task (a :class:`~rewards.vvr.Task` or its dict). A
    sample without a task, or whose image cannot be read (blank, non-finite), is invalid: masked, with
    the reason in ``info``. A malformed task raises ``ValueError`` (a bug in the caller, not a sample).
    """

    name = "vvr"
    differentiable = False
    #: a program, no model: nothing on the device (flowalign plan)
    planned_bytes = staticmethod(holds_nothing)
    #: per-prompt metadata this reward scores against (checked before any sampling)
    requires_metadata = ("task",)

    def __init__(self, gamma: float = GAMMA, partial_credit: bool = False):
        self.gamma = checked_gamma(gamma, self.name)
        #: [derived] also credit each object the prompt names (a constraint's reference, or a count's
        #: colour/shape) when some detected object matches it, so a task with one relation (binary under
        #: the plain reward) still ranks "both objects right, wrong place" above "nothing right". Only
        #: what the prompt says is credited: the scene's unnamed attributes (the shapes behind "exactly
        #: two yellow objects") are not knowable from the prompt and would be reward noise. A training
        #: signal only: ``all_passed`` and benchmark accuracy are unchanged.
        self.partial_credit = partial_credit

    def __call__(self, samples: torch.Tensor, prompts: list[str], metadata: list[dict[str, Any]]) -> RewardOutput:
        """``samples``: ``(B, 3, H, W)`` float in [0, 1] → components ``{"vvr": (B,)}``, ``valid`` ``(B,)``."""
        if samples.ndim != 4 or samples.shape[1] != 3:
            raise UserError(
                f"vvr reward scores images (B, 3, H, W); got samples of shape {tuple(samples.shape)}"
                " (videos are not supported)"
            )
        n = samples.shape[0]
        # one conversion for the batch; non-finite samples are caught per sample below
        finite = torch.isfinite(samples).flatten(1).all(1).tolist()
        pixels = (samples.detach().float().nan_to_num(0.0).clamp(0, 1) * 255).round().to(torch.uint8)
        pixels = pixels.permute(0, 2, 3, 1).cpu().numpy()
        scores = torch.zeros(n, dtype=torch.float32)
        valid = torch.zeros(n, dtype=torch.bool)
        info: list[dict[str, Any]] = []
        for i, task in tasks_to_score(metadata, finite, "image", info):
            verdict = verify(task, pixels[i])
            info.append({"constraints": verdict.constraints, "all_passed": verdict.all_passed, "reason": verdict.reason,
                         "shapes": shapes_named(task)})
            if verdict.valid:
                valid[i] = True
                passed = [p for _, p in verdict.constraints]
                credits = _named_objects_drawn(task, verdict.detected) + passed if self.partial_credit else None
                scores[i] = verdict_score(passed, verdict.all_passed, self.gamma, credits)
        return RewardOutput(components={"vvr": scores}, valid=valid, info=info)


def checked_gamma(gamma: float, reward: str) -> float:
    """``gamma`` if it lies in [0, 1], else a ``UserError`` naming the ``reward``."""
    if not 0.0 <= gamma <= 1.0:
        raise UserError(f"{reward} reward: gamma must lie in [0, 1], got {gamma}")
    return gamma


def tasks_to_score(
    metadata: list[dict[str, Any]], finite: list[bool], what: str, info: list[dict[str, Any]]
) -> Iterator[tuple[int, Any]]:
    """``(i, task)`` for each sample ``i`` that can be verified; for any other one (no task in its metadata,
    or its ``what`` — "image", "video" — is not ``finite``) appends to ``info`` the entry saying why."""
    for i, ok in enumerate(finite):
        task = metadata[i].get("task") if i < len(metadata) and metadata[i] else None
        if task is None:
            info.append({"constraints": [], "all_passed": False, "reason": f"metadata[{i}] has no 'task'"})
        elif not ok:
            info.append({"constraints": [], "all_passed": False, "reason": f"{what} has NaN or infinite values"})
        else:
            yield i, task


def blended_score(credits: list[float], all_passed: bool, gamma: float) -> float:
    """The partial-credit reward ``(1-γ)·mean(credits) + γ·all_passed``."""
    return (1 - gamma) * sum(credits) / len(credits) + gamma * float(all_passed)


def verdict_score(passed: list[bool], all_passed: bool, gamma: float, credits: list[float] | None) -> float:
    """A verified sample's reward: :func:`blended_score` of its partial ``credits`` when the reward grants them
    (not None), else :func:`rewards.vvr.verify.score` of the pass/fail checks."""
    return blended_score(credits, all_passed, gamma) if credits is not None else score(passed, gamma)


def shapes_named(task: Any) -> list[str]:
    """The shapes a task's constraints name, sorted (what ``flowalign compare --by shape`` groups by)."""
    shapes = {r["shape"] for c in as_task(task).constraints for k, r in c.args.items()
              if k in ("ref", "a", "b", "c") and "shape" in r}
    return sorted(shapes | {c.args["shape"] for c in as_task(task).constraints if "shape" in c.args})


#: constraints whose reference must not be drawn (or not too often): no credit for drawing it
_NOT_CREDITED = frozenset({"absent", "at_most"})


def _named_objects_drawn(task: Any, detected: list[dict[str, Any]]) -> list[bool]:
    """Per object description the prompt names (deduplicated): does some detected object match it?

    Descriptions are the constraints' references (``ref``/``a``/``b``/``c``: colour and/or shape) and
    the counted descriptor of ``count_colour``/``count_shape``/``count_colour_shape``; ``total_count``
    names none, and the references of ``absent``/``at_most`` are not credited. Matching is the
    verifier's own (:func:`~rewards.vvr.verify.matches`).
    """
    named: list[dict[str, str]] = []
    for c in as_task(task).constraints:
        if c.type in _NOT_CREDITED:
            continue
        refs = [c.args[k] for k in ("ref", "a", "b", "c") if k in c.args]
        if c.type.startswith("count_"):
            refs.append({k: c.args[k] for k in ("colour", "shape") if k in c.args})
        named += [r for r in refs if r and r not in named]
    return [any(matches(r, d["colour"], d["shape"]) for d in detected) for r in named]
