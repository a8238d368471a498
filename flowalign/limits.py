"""Upper bounds on inputs that would otherwise spend unbounded memory or time before anything fails.

Each bound sits far above any real use, so it only ever refuses a typo or a hostile file (``data.n=1e12``,
a 20 MB prompt line, a YAML alias bomb), and it is checked before the memory is spent. The config fields
and the CLI options name the bound they break in their one-line error.
"""

from __future__ import annotations

#: sampling / rollout steps T: published schedules use 1 to ~100; every step keeps latents for training
MAX_SAMPLING_STEPS = 1000
#: samples per prompt (a group): published recipes use 2 to ~64
MAX_GROUP_SIZE = 1024
#: prompts per step and samples per batch: a batch's latents are held in memory at once
MAX_BATCH = 4096
#: tasks drawn from a benchmark generator (``data.n``, ``eval.n``, ``--n``): each is built in memory
MAX_TASKS = 1_000_000
#: seeds are non-negative and fit torch's and numpy's 64-bit generators
MAX_SEED = 2**63 - 1
#: learning rates: real ones are 1e-6 to 1e-2; a larger one blows the weights up within a step
MAX_LR = 1.0
#: characters of one prompt: text encoders read at most ~1-2k tokens (a few thousand characters)
MAX_PROMPT_CHARS = 20_000
#: bytes of a YAML config file (real ones are a few KB)
MAX_CONFIG_BYTES = 10 * 2**20
#: values of a YAML document once its aliases are expanded (a real config has a few hundred)
MAX_YAML_NODES = 100_000
