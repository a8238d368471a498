"""A streaming trainer's differentiated chunk calls, each recomputed in the backward pass when the run checkpoints
(``model.gradient_checkpointing``): only a call's inputs are kept through the loss, and one call at a time is
recomputed, as the KVPO / LongLive code wraps each generator call in ``torch.utils.checkpoint``. Without it a
loss over many chunk calls (KVPO's branches × window chunks × steps) keeps every call's block inputs at once."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.checkpoint import checkpoint


def chunk_velocity(policy: Any, checkpointed: bool, x_chunk: torch.Tensor, sigma: float, sigma_next: float,
                   cache: Any, cond: Any, guidance: float) -> torch.Tensor:
    """``policy.chunk_velocity(...)`` ``(B, C, f, H, W)``; with ``checkpointed`` and gradients on, recomputed in the
    backward pass (the same values: the call draws nothing)."""
    if checkpointed and torch.is_grad_enabled():
        return checkpoint(policy.chunk_velocity, x_chunk, sigma, sigma_next, cache, cond, guidance,
                          use_reentrant=False)
    return policy.chunk_velocity(x_chunk, sigma, sigma_next, cache, cond, guidance)
