"""MotionInsight-style motion fidelity: a clip's moving objects diagnosed in motion space.

From the frames, each designated object becomes a track (``segment`` → ``space``: position, velocity,
acceleration, size, shape descriptors over time); ``diagnose`` scores three dimensions in [0, 1] with a
failure cause each (consistency, continuity, plausibility); ``reward`` registers ``motion_insight`` and
``motion_insight.<dimension>``. ``defects`` injects known defects into VVR motion clips, what the
diagnosis is measured against (``scripts/motion_insight_diagnostics.py``). See
``docs/methods/motion_insight.md``.
"""

from rewards.motion_insight.diagnose import DIMENSIONS, Dimension, Finding, diagnose
from rewards.motion_insight.reward import DimensionReward, MotionInsightReward
from rewards.motion_insight.space import MotionSpace, ObjectTrack, build

__all__ = ["DIMENSIONS", "Dimension", "DimensionReward", "Finding", "MotionInsightReward", "MotionSpace",
           "ObjectTrack", "build", "diagnose"]
