"""Verifiable motion tasks: VVR scenes extended in time, their prompts, renderer and a deterministic verifier.

See ``docs/methods/vvr_motion.md`` (and ``rewards.vvr``, the still-image grammar and verifier this
builds on) and ``verify`` for the motion checks. Public interface: :func:`generate_tasks` (training
draws, held-out compositions excluded), :func:`load_split` (``validation`` / ``test``),
:class:`MotionTask` (``MotionObj``, ``MotionConstraint``), :func:`render` → ``(F, H, W, 3)`` uint8, :func:`verify` → VVR's
:class:`~rewards.vvr.Verdict`, :func:`temporal_consistency`, ``CONSTRAINT_TYPES`` and the rewards
``vvr_motion`` / ``temporal_consistency`` (registered on import). Clips have ``NUM_FRAMES`` = 9 frames
by default (Wan's VAE takes 4k+1).
"""

from rewards.vvr.verify import Verdict
from rewards.vvr_motion.consistency import Consistency, temporal_consistency
from rewards.vvr_motion.generate import generate_heldout_tasks, generate_tasks
from rewards.vvr_motion.heldout import HELDOUT_MOVES, HELDOUT_RELATIVE, HELDOUT_RESIZES, is_heldout
from rewards.vvr_motion.render import render
from rewards.vvr_motion.reward import TemporalConsistencyReward, VVRMotionReward
from rewards.vvr_motion.splits import SPLIT_SEEDS, SPLITS, load_split
from rewards.vvr_motion.tasks import (
    CONSTRAINT_TYPES,
    MOTION_DIRECTIONS,
    NUM_FRAMES,
    MotionConstraint,
    MotionObj,
    MotionTask,
)
from rewards.vvr_motion.verify import verify

__all__ = [
    "CONSTRAINT_TYPES", "Consistency", "HELDOUT_MOVES", "HELDOUT_RELATIVE", "HELDOUT_RESIZES", "MOTION_DIRECTIONS",
    "MotionConstraint", "MotionObj", "MotionTask", "NUM_FRAMES", "SPLITS", "SPLIT_SEEDS", "TemporalConsistencyReward",
    "VVRMotionReward", "Verdict", "generate_heldout_tasks", "generate_tasks", "is_heldout", "load_split", "render",
    "temporal_consistency", "verify",
]
