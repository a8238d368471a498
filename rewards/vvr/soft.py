"""The registered ``vvr_soft`` reward: a smooth, differentiable pixel-space score of a VVR task.

Gradient-based trainers (DiffusionOPSD) need ``∇_image R``; the verifier (``vvr``) is a pipeline of
thresholds and connected components with no gradient. This surrogate scores the same task from the same
metadata with smooth stand-ins [derived], and the hard verifier stays the judge of accuracy:

* **soft colour masks** — each pixel's CIELAB colour against the palette centres,
  ``p_k ∝ (1 + ΔE76(pixel, k)²/τ²)^−4``: a ``(K, H, W)`` membership per palette colour (heavy-tailed,
  so a pixel of no palette colour still has a gradient toward each).
* **descriptors → masks** — a reference ``{"colour", "shape"}`` selects the colours of the scene
  objects it matches (its own colour when named), so a shape-only reference ("two stars") reads the
  colours the task's scene gives those stars. Masks do not measure shape (only through the area a
  shape of that size class covers); the optional shape term below does.
* **soft counts via mass** — ``N = (mass(mask) − expected area of same-coloured non-matching
  objects) / mean area of a matching object``; areas come from the scene's objects (shape, size class).
* **relations via soft centroids** — mass-weighted centroids, compared with the verifier's margins
  through sigmoids of width ``t`` (image fractions).
* **sizes via mass** — a log-area comparison against the size class's expected area.
* **shapes via templates** (``shapes=True``) — the verifier's own test, softened: on the object's
  coverage (unmixed from the pixels as ``segment._cover`` does) each shape's template is placed by
  moments (``segment.placements_by_moments``, the verifier's placement), and the named shape must beat
  every other shape's soft IoU ``Σmin/Σmax`` less the same aspect penalty; the placement is held fixed,
  so the gradient moves pixels toward the named template and away from the closest rival (a circle
  drawn so that it reads as a hexagon gets rounder).

Each constraint gets ``s_j ∈ (0, 1)``; the reward is the verifier's form
``(1−γ)·mean_j s_j + γ·Π_j s_j`` in [0, 1]. How well it ranks samples against the verifier is measured
in ``docs/results.md``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from flowalign.errors import UserError
from flowalign.protocols import RewardOutput
from rewards.planning import holds_nothing
from rewards.registry import register
from rewards.vvr.soft_scene import COUNT_TYPES, WORK, SoftScene, colour_memberships, srgb_to_lab  # noqa: F401
from rewards.vvr.tasks import as_task
from rewards.vvr.verify import GAMMA


@register("vvr_soft")
class VVRSoftReward:
    """Differentiable VVR surrogate ``R = (1-γ)·mean_j s_j + γ·Π_j s_j`` per sample, in [0, 1].

    ``samples`` ``(B, 3, H, W)`` float in [0, 1] (any float dtype; scored in float32) → components
    ``{"vvr_soft": (B,)}`` differentiable in ``samples``. ``metadata[i]["task"]`` is the VVR task (a
    :class:`~rewards.vvr.Task` or its dict); a sample without one, or with non-finite pixels, is invalid
    (score 0, no gradient). ``temperature`` is the colour softmax's ΔE76 scale; ``sharpness`` the width
    of the positional sigmoids in image fractions. ``count_gradients=False`` keeps every score but cuts
    the gradient of counts and of relations' presence factors: a count read from soft mass is raised by
    growing objects, not by adding one, and ascending it lowered the verifier's score
    (``docs/results.md``). ``shapes=True`` also scores (and passes the
    gradient of) whether each named shape reads as that shape, by the verifier's template test.
    """

    name = "vvr_soft"
    differentiable = True
    #: a program, no model: nothing on the device (flowalign plan)
    planned_bytes = staticmethod(holds_nothing)

    def __init__(self, gamma: float = GAMMA, temperature: float = 12.0, sharpness: float = 0.03,
                 count_gradients: bool = True, shapes: bool = False):
        if not 0.0 <= gamma <= 1.0:
            raise UserError(f"vvr_soft reward: gamma must lie in [0, 1], got {gamma}")
        if temperature <= 0 or sharpness <= 0:
            raise UserError(f"vvr_soft reward: temperature and sharpness must be > 0, got {temperature}, {sharpness}")
        self.gamma, self.temperature, self.sharpness = gamma, temperature, sharpness
        self.count_gradients, self.shapes = count_gradients, shapes

    def __call__(self, samples: torch.Tensor, prompts: list[str], metadata: list[dict[str, Any]]) -> RewardOutput:
        if samples.ndim != 4 or samples.shape[1] != 3:
            raise UserError(f"vvr_soft reward scores images (B, 3, H, W); got samples of shape {tuple(samples.shape)}")
        n = samples.shape[0]
        x = samples.float()
        if max(x.shape[-2:]) > WORK:
            x = F.adaptive_avg_pool2d(x, [max(1, round(s * WORK / max(x.shape[-2:]))) for s in x.shape[-2:]])
        finite = torch.isfinite(x).flatten(1).all(1)
        member = colour_memberships(torch.where(finite[:, None, None, None], x, torch.zeros_like(x)), self.temperature)
        scores, valid, info = [], torch.zeros(n, dtype=torch.bool), []
        for i in range(n):
            task = metadata[i].get("task") if i < len(metadata) and metadata[i] else None
            if task is None or not bool(finite[i]):
                scores.append(member[i].sum() * 0.0)  # keeps the graph connected; no gradient
                info.append({"reason": f"metadata[{i}] has no 'task'" if task is None else "image has NaN or infinite values"})
                continue
            scene = SoftScene(x[i], member[i], as_task(task), self.sharpness, self.count_gradients, self.shapes)
            s = torch.stack([scene.score(c) for c in scene.task.constraints])
            scores.append((1 - self.gamma) * s.mean() + self.gamma * s.prod())
            valid[i] = True
            info.append({"constraints": [(c.type, float(v)) for c, v in zip(scene.task.constraints, s.detach())]})
        return RewardOutput(components={"vvr_soft": torch.stack(scores)}, valid=valid, info=info)
