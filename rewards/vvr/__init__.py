"""Verifiable Visual Rewards (VVR): generated geometric scenes, prompts and a deterministic verifier.

See ``docs/methods/vvr.md``. Public interface: :func:`generate_tasks` (training draws, held-out
compositions excluded), :func:`generate_heldout_tasks`, :func:`load_split` (``validation`` / ``test``),
:class:`Task`, :func:`render`, :func:`verify` / :class:`Verdict`, the ``vvr`` reward (:class:`VVRReward`,
registered on import) and ``CONSTRAINT_TYPES``; per-level vocabularies in ``VOCABULARIES``; the held-out
compositions in ``rewards.vvr.heldout``; scene building (shared with ``rewards.vvr_motion``) in
``rewards.vvr.scene``.
"""

from rewards.vvr.generate import generate_heldout_tasks, generate_tasks
from rewards.vvr.heldout import HELDOUT_COUNTS, HELDOUT_PAIRS, HELDOUT_RELATIONS, is_heldout
from rewards.vvr.render import render
from rewards.vvr.reward import VVRReward
from rewards.vvr.soft import VVRSoftReward  # registers vvr_soft
from rewards.vvr.splits import SPLIT_SEEDS, SPLITS, load_split
from rewards.vvr.tasks import CONSTRAINT_TYPES, Constraint, Obj, Task
from rewards.vvr.verify import Verdict, verify
from rewards.vvr.vocabulary import (
    EASY_COLOURS,
    EASY_SHAPES,
    MEDIUM_COLOURS,
    MEDIUM_SHAPES,
    VOCABULARIES,
    Vocabulary,
)

__all__ = [
    "CONSTRAINT_TYPES", "Constraint", "EASY_COLOURS", "EASY_SHAPES", "HELDOUT_COUNTS", "HELDOUT_PAIRS",
    "HELDOUT_RELATIONS", "MEDIUM_COLOURS", "MEDIUM_SHAPES", "Obj", "SPLITS", "SPLIT_SEEDS", "Task",
    "VOCABULARIES", "VVRReward", "VVRSoftReward", "Verdict", "Vocabulary", "generate_heldout_tasks",
    "generate_tasks", "is_heldout", "load_split", "render", "verify",
]
