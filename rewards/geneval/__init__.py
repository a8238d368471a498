"""GenEval-style compositional reward and prompt sets (see ``docs/methods/geneval.md``).

:mod:`rewards.geneval.rules` holds GenEval's rules on detections (pure, tested on hand-built detections);
:mod:`~rewards.geneval.detector` and :mod:`~rewards.geneval.colour` the transformers models;
:mod:`~rewards.geneval.prompts` the project's generated prompt set and its held-out compositions;
:func:`~rewards.geneval.tiny.save_tiny_geneval` a random, architecture-faithful folder for tests.
"""

from rewards.geneval.reward import GenEvalReward  # registers "geneval"

__all__ = ["GenEvalReward"]
