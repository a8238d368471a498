"""flowalign: align flow-matching image and video generators with RL and preference optimisation.

The core package: step math, rollouts, trainers, configs, checkpoints, galleries and the CLI. It never
imports a concrete model family (``pipelines``) or reward (``rewards``); they meet through the
protocols in :mod:`flowalign.protocols` and registries filled by name.
"""

from flowalign.errors import UserError

__version__ = "0.1.0"
__all__ = ["UserError", "__version__"]
