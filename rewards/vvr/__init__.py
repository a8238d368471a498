"""Verifiable Visual Rewards (VVR): generated geometric scenes, prompts and a deterministic verifier.

See ``shared/specs/vvr.md``. Public interface: :func:`generate_tasks`, :class:`Task`, :func:`render`,
:func:`verify` / :class:`Verdict`, the ``vvr`` reward (:class:`VVRReward`) and ``CONSTRAINT_TYPES``.
"""

from rewards.vvr.generate import VOCABULARIES, Vocabulary, generate_tasks
from rewards.vvr.render import render
from rewards.vvr.tasks import CONSTRAINT_TYPES, Constraint, Obj, Task

__all__ = ["CONSTRAINT_TYPES", "Constraint", "Obj", "Task", "VOCABULARIES", "Vocabulary", "generate_tasks", "render"]
