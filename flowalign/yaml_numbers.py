"""YAML's ``true`` is not a number: it loads as a Python ``bool``, a subclass of ``int``, so a field or
option annotated ``int`` or ``float`` would silently take it as 1 (``max_tokens: true`` asking for one token).
Config sections (:mod:`flowalign.config`) and reward options (:mod:`rewards.registry`) both refuse it for
the annotations this module recognises as numeric."""

from __future__ import annotations

from types import UnionType
from typing import Any, Union, get_args, get_origin


def numeric_annotation(annotation: Any) -> bool:
    """``int``, ``float`` or an optional one (the annotations a YAML ``true`` must not satisfy as 1)."""
    union = get_origin(annotation) in (Union, UnionType)
    args = [a for a in get_args(annotation) if a is not type(None)] if union else [annotation]
    return bool(args) and all(a in (int, float) for a in args)
