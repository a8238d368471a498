"""A step's logged values, merged over its loss units and optimiser steps.

A unit's ``info`` (and the gradient norm of each optimiser step) may be a float or a 0-dimensional tensor
still on the device: reading a tensor back (``.item()``) makes the host wait for everything queued on the
GPU, so a value read at every unit keeps the host from running ahead of the device. The loop keeps the
tensors as they come and reads them back together at the end of the step: one wait per device.
"""

from __future__ import annotations

from typing import Any, Union

import numpy as np
import torch

Logged = Union[float, torch.Tensor]

#: logged values a step reports as the largest over its units, not the mean: ``ratio_dev`` is the on-policy
#: ratio's largest deviation from 1 (max |ratio − 1| on the batch's first pass)
MAX_LOGS = frozenset({"ratio_dev"})


def read_back(stats: dict[Any, list[Logged]]) -> dict[Any, list[float]]:
    """``stats`` (keyed by name, or by (optimiser step, name)) with every tensor read back as a float: one
    stacked copy to the host per device (float64, so a float32 value reads back as ``.item()`` would give it)."""
    by_device: dict[torch.device, list[tuple[Any, int, torch.Tensor]]] = {}
    out = {key: list(values) for key, values in stats.items()}
    for key, values in stats.items():
        for i, value in enumerate(values):
            if isinstance(value, torch.Tensor):
                if value.numel() != 1:
                    named = f"{key[1]!r} (optimiser step {key[0]})" if isinstance(key, tuple) else repr(key)
                    raise ValueError(f"logged value {named} has shape {tuple(value.shape)}; log a scalar")
                by_device.setdefault(value.device, []).append((key, i, value.detach().reshape(())))
    for entries in by_device.values():
        for (key, i, _), number in zip(entries, torch.stack([t.double() for _, _, t in entries]).tolist()):
            out[key][i] = number
    return out


def merged(stats: dict[str, list[Logged]]) -> dict[str, float]:
    """Each key's mean over its values (the largest for :data:`MAX_LOGS`), read back once (:func:`read_back`)."""
    return {k: float(np.max(v) if k in MAX_LOGS else np.mean(v)) for k, v in read_back(stats).items()}


def read_back_steps(steps: list[dict[str, list[Logged]]]) -> list[dict[str, list[float]]]:
    """Each optimiser step's logged values (key → this rank's values, unit by unit) read back as floats, all
    steps at once (:func:`read_back`)."""
    flat = read_back({(n, key): values for n, step in enumerate(steps) for key, values in step.items()})
    out: list[dict[str, list[float]]] = [{} for _ in steps]
    for (n, key), values in flat.items():
        out[n][key] = values
    return out


def concatenated(steps: list[dict[str, list[float]]]) -> dict[str, list[float]]:
    """Every step's values of a key, one list a key in step order (for :func:`merged`)."""
    out: dict[str, list[float]] = {}
    for step in steps:
        for key, values in step.items():
            out.setdefault(key, []).extend(values)
    return out
