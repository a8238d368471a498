"""Super-resolution benchmark ``sr``: (LR, HR) pairs of rendered VVR scenes under real-world degradations.

Public interface: :class:`SRTask`, :func:`generate_sr_tasks` (training draws), :func:`load_split`
(``validation`` / ``test``; no scene in common with training or each other), :func:`render_hr` /
:func:`render_lr`, the degradation pipeline (:class:`Degradation`, :func:`degrade`, :func:`draw_degradation`,
``KINDS``, ``STRENGTHS``). The LR image is the conditioning image of an image-conditioned model (FLUX.1
Kontext), the HR its target; the ``compass`` / ``compass_fr`` rewards (:mod:`rewards.compass`) score outputs.
Method: ``docs/methods/oars.md``.
"""

from rewards.sr.degrade import KINDS, STRENGTHS, Degradation, degrade, draw_degradation, lr_size
from rewards.sr.tasks import (
    HR_SIZE, LEVELS, SPLIT_SEEDS, SPLIT_SIZE, SPLITS, SR_PROMPT, SRTask, as_sr_task, generate_sr_tasks, load_split,
    render_hr, render_lr, scene_key,
)

__all__ = [
    "Degradation", "HR_SIZE", "KINDS", "LEVELS", "SPLITS", "SPLIT_SEEDS", "SPLIT_SIZE", "SRTask", "SR_PROMPT",
    "STRENGTHS", "as_sr_task", "degrade", "draw_degradation", "generate_sr_tasks", "load_split", "lr_size",
    "render_hr", "render_lr", "scene_key",
]
