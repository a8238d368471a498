"""JSON as RFC 8259 defines it: Python's ``json`` writes NaN and Infinity, which are not JSON and which
strict readers (browsers, ``jq``, other languages) refuse. Results are written through :func:`dumps`,
which writes a non-finite number as ``null`` (no value) and never emits those tokens."""

from __future__ import annotations

import json
import math
from typing import Any


def finite_or_null(data: Any) -> Any:
    """``data`` with every NaN or infinite float (in nested dicts, lists and tuples) replaced by None."""
    if isinstance(data, float):
        return data if math.isfinite(data) else None
    if isinstance(data, dict):
        return {k: finite_or_null(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [finite_or_null(v) for v in data]
    return data


def dumps(data: Any, **kwargs: Any) -> str:
    """``json.dumps`` of ``data`` with non-finite numbers as ``null`` (``allow_nan=False`` guards the rest)."""
    return json.dumps(finite_or_null(data), allow_nan=False, **kwargs)
