"""What a meta-device measurement of a model depends on, as a cache key: the model's class, config and dtype,
and the inputs' shapes (a forward's FLOPs in :mod:`flowalign.flop_meter`, its saved bytes in
:mod:`flowalign.plan`). Two models with one key give the same measurement, so a process measures each once."""

from __future__ import annotations

import json
from typing import Any

import torch
from torch import nn


def model_class(module: nn.Module) -> type:
    """The model's own class (under FSDP2, the class its wrapper class was made from)."""
    cls = type(module)
    while cls.__name__.startswith("FSDP") and len(cls.__bases__) > 1:  # FSDP2's wrapper class
        cls = cls.__bases__[-1]
    return cls


def model_signature(module: nn.Module) -> tuple[str, str, str]:
    """The model's class name, its config as sorted JSON and its parameters' dtype."""
    config = json.dumps(dict(getattr(module, "config", {}) or {}), sort_keys=True, default=str)
    return model_class(module).__qualname__, config, str(next(module.parameters()).dtype)


def input_signature(value: Any) -> Any:
    """Inputs as a hashable key: each tensor's shape and dtype, each other value as written (lists and
    tuples item by item, dicts by sorted key)."""
    if isinstance(value, torch.Tensor):
        return tuple(value.shape), str(value.dtype)
    if isinstance(value, (list, tuple)):
        return tuple(input_signature(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, input_signature(v)) for k, v in value.items()))
    return repr(value)
