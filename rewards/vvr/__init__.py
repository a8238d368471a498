"""Verifiable Visual Rewards (VVR): generated geometric scenes, prompts and a deterministic verifier.

See ``shared/specs/vvr.md``. Public interface: :func:`generate_tasks`, :class:`Task`, :func:`render`,
:func:`verify` / :class:`Verdict`, the ``vvr`` reward (:class:`VVRReward`, registered on import) and
``CONSTRAINT_TYPES``; per-level vocabularies in ``VOCABULARIES``.
"""

from rewards.vvr.generate import (
    EASY_COLOURS,
    EASY_SHAPES,
    MEDIUM_COLOURS,
    MEDIUM_SHAPES,
    VOCABULARIES,
    Vocabulary,
    generate_tasks,
)
from rewards.vvr.render import render
from rewards.vvr.reward import VVRReward
from rewards.vvr.soft import VVRSoftReward  # registers vvr_soft
from rewards.vvr.tasks import CONSTRAINT_TYPES, Constraint, Obj, Task
from rewards.vvr.verify import Verdict, verify

__all__ = [
    "CONSTRAINT_TYPES", "Constraint", "EASY_COLOURS", "EASY_SHAPES", "MEDIUM_COLOURS", "MEDIUM_SHAPES", "Obj",
    "Task", "VOCABULARIES", "VVRReward", "Verdict", "Vocabulary", "generate_tasks", "render", "verify",
]
