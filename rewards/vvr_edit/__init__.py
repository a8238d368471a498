"""VVR editing benchmark: a rendered VVR scene, an edit instruction, and a deterministic check of the edit.

Public interface: :class:`EditTask` (``EDIT_KINDS``: recolour, move, remove, add), :func:`generate_edit_tasks`
(levels, seeds, held-out compositions ``HELDOUT_PAIRS``), :func:`load_split` (``validation`` / ``test``),
:func:`render_source` / :func:`render_result`, :func:`verify_edit` → VVR's :class:`~rewards.vvr.Verdict`, and
the ``vvr_edit`` reward (:class:`VVREditReward`, registered on import) and its parts ``vvr_edit.instruction`` and
``vvr_edit.preservation``. Method: ``docs/methods/vvr_edit.md``.
"""

from rewards.vvr_edit.generate import HELDOUT_PAIRS, generate_edit_tasks
from rewards.vvr_edit.reward import VVREditInstruction, VVREditPreservation, VVREditReward, render_result, render_source
from rewards.vvr_edit.splits import SPLIT_SEEDS, load_split
from rewards.vvr_edit.tasks import EDIT_KINDS, RELATIONS, EditTask
from rewards.vvr_edit.verify import instruction_constraints, verify_edit

__all__ = [
    "EDIT_KINDS", "EditTask", "HELDOUT_PAIRS", "RELATIONS", "SPLIT_SEEDS", "VVREditInstruction", "VVREditPreservation",
    "VVREditReward", "generate_edit_tasks",
    "instruction_constraints", "load_split", "render_result", "render_source", "verify_edit",
]
