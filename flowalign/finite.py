"""Non-finite numbers: refused in configs, and a training run whose loss or weights stop being finite is
stopped before it can write a checkpoint (the last one written stays the last good one)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from flowalign.errors import UserError


def non_finite_key(data: Any, prefix: str = "") -> tuple[str, float] | None:
    """The dotted key and value of the first NaN or infinite float in nested dicts and lists (None: all
    finite)."""
    if isinstance(data, float) and not math.isfinite(data):
        return (prefix.rstrip(".") or "value"), data
    if isinstance(data, dict):
        items = ((f"{prefix}{k}", v) for k, v in data.items())
    elif isinstance(data, (list, tuple)):
        items = ((f"{prefix.rstrip('.')}[{i}]", v) for i, v in enumerate(data))
    else:
        return None
    for key, value in items:
        found = non_finite_key(value, key + "." if isinstance(value, dict) else key)
        if found:
            return found
    return None


def weight_labels(named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Trained tensors keyed as :func:`check_training_finite` names them."""
    return {f"weight {n}": p for n, p in named.items()}


def check_training_finite(step: int, logs: dict[str, float], tensors: dict[str, torch.Tensor], run_dir: Path) -> None:
    """Raise ``UserError`` naming the step and the non-finite gradient norm or tensor (and losses, if any).

    The decision rests on quantities every rank shares (the all-reduced gradient norm, the replicated
    weights), so all ranks stop at the same step; a rank's own non-finite losses only explain it.

    Args:
        step: the step just trained (1-based, as logged).
        logs: that step's scalars.
        tensors: tensors that must be finite, by what to call them (``"weight <name>"``, ``"sampled outputs"``).
        run_dir: the run folder (its newest checkpoint is named as the one to resume from).
    """
    norm = logs.get("train/grad_norm", 0.0)
    bad = None if math.isfinite(norm) else f"train/grad_norm ({norm})"
    if bad is None:
        bad = next((label for label, t in tensors.items() if not torch.isfinite(t.detach()).all()), None)
    if bad is None:
        return
    losses = [f"{k} ({v})" for k, v in logs.items() if k.startswith("train/") and "loss" in k and not math.isfinite(v)]
    if losses:
        bad += f" after {', '.join(losses)}"
    from flowalign.checkpoint import latest_checkpoint

    last = latest_checkpoint(run_dir)
    kept = f"the last good checkpoint is {last}" if last else "no checkpoint was written"
    raise UserError(f"step {step}: non-finite {bad}; stopped without saving ({kept}); lower trainer.lr or "
                    "trainer.grad_clip, or check the reward")
