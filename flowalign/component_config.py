"""A diffusers folder's component ``config.json`` checked against the class it builds, before the class sees it.

diffusers and transformers pass a config's values straight to the constructor: ``num_layers: -5`` builds a
model with no blocks (loading then drops every block's weights with a warning and samples noise),
``num_layers: "many"`` ends in a ``TypeError`` from ``range``, and a list instead of a mapping in a
network error. Every setting the constructor declares as a whole number or a real number is checked
here, one line naming the file, the field and the fix. The lower bound comes from the constructor's
default: a count or size (``num_*``, ``*_dim``, ``*channels``, ``*heads``, ``*layers``, ``*_size``) that
defaults to a positive value must be at least 1, any other setting with a default of 0 or more must not
be negative; token ids and indices (``*_id``, ``*_index``) are only checked to be whole numbers.
"""

from __future__ import annotations

import importlib
import inspect
import json
import math
import re
from pathlib import Path
from typing import Any

from flowalign.errors import UserError
from flowalign.limits import MAX_MODEL_LAYERS, MAX_MODEL_SIZE

#: annotations (as diffusers writes them, or as strings under postponed evaluation) of whole-number and
#: real-number settings; the second of each pair also takes null
_INT = ({"int", "<class 'int'>"}, {"int | None", "Optional[int]", "typing.Optional[int]"})
_FLOAT = ({"float", "<class 'float'>", "int | float", "float | int"},
          {"float | None", "Optional[float]", "typing.Optional[float]"})
#: settings that count or size something: with a positive default, 0 builds nothing of it
_COUNT = re.compile(r"^num_|^d_|_dims?$|channels$|heads$|layers$|_size$|^hidden_size$")
#: settings that count layers or blocks (bounded by MAX_MODEL_LAYERS; other counts by MAX_MODEL_SIZE)
_LAYERS = re.compile(r"layers$|blocks$|^depth$")
#: ids and indices: -1 and 0 are ordinary values
_ID = re.compile(r"_ids?$|_index$")


def library_module(library: str) -> Any:
    """The module a ``model_index.json`` entry names: a package (``diffusers``, ``transformers``) or, as diffusers
    resolves it, a pipeline's own module (``["<pipeline module>", "<class>"]`` → ``diffusers.pipelines.<module>``)."""
    try:
        return importlib.import_module(library)
    except ModuleNotFoundError:
        return importlib.import_module(f"diffusers.pipelines.{library}")


def config_class(cls: type) -> type:
    """The class whose constructor takes the settings of ``config.json``: a transformers model's config
    class, else the (diffusers) class itself."""
    return getattr(cls, "config_class", None) or cls


def read_component_config(folder: str | Path, name: str, cls: type | None = None) -> dict[str, Any]:
    """``folder/name/config.json`` as a mapping, each declared number of ``cls``'s constructor checked; a
    missing, damaged or wrong-shaped file is one :class:`UserError` line."""
    path = Path(folder) / name / "config.json"
    where = f"model folder {folder}: {name}/config.json"
    if not path.is_file():
        raise UserError(f"{where} is missing; restore it from the original download")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        detail = f"line {e.lineno}: {e.msg}" if isinstance(e, json.JSONDecodeError) else "not UTF-8 text"
        raise UserError(f"{where} is damaged ({detail}); restore it from the original download") from None
    if not isinstance(data, dict):
        raise UserError(f"{where} holds a JSON {type(data).__name__}, not a mapping of settings; restore it from "
                        "the original download")
    if cls is not None:
        check_settings(data, config_class(cls), where)
    return data


def check_settings(data: dict[str, Any], cls: type, where: str) -> None:
    """Refuse a value of ``data`` that ``cls``'s constructor declares as a number but that is not one, or
    that lies below what its default implies (see the module docstring)."""
    try:
        params = inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):  # a builtin constructor: nothing declared to check against
        return
    for key, param in params.items():
        if key not in data or key == "self":
            continue
        value, default = data[key], param.default
        ann = param.annotation if isinstance(param.annotation, str) else str(param.annotation)
        whole = ann in _INT[0] | _INT[1] or (ann == str(inspect.Parameter.empty) and _is_int(default))
        real = ann in _FLOAT[0] | _FLOAT[1] or (ann == str(inspect.Parameter.empty) and _is_real(default)
                                                and not whole)
        if not (whole or real):
            continue
        if value is None and (ann in _INT[1] | _FLOAT[1] or default is None):
            continue
        example = default if _is_real(default) else (1 if whole else 1.0)
        if whole and not _is_int(value):
            raise UserError(f"{where}: {key}={_shown(value)} must be a whole number (e.g. {example}); "
                            "fix the field or restore the file from the original download")
        if real and not (_is_real(value) and math.isfinite(value)):
            raise UserError(f"{where}: {key}={_shown(value)} must be a finite number (e.g. {example}); "
                            "fix the field or restore the file from the original download")
        if whole and _is_int(default) and default >= 0 and not _ID.search(key):
            low = 1 if default > 0 and _COUNT.search(key) else 0
            high = MAX_MODEL_LAYERS if _LAYERS.search(key) else MAX_MODEL_SIZE
            if not low <= value <= high:
                raise UserError(f"{where}: {key}={value} must be between {low} and {high:,} (e.g. {default}); "
                                "fix the field or restore the file from the original download")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _shown(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."
