"""A model folder's parts checked before diffusers loads it: one line naming the broken part.

diffusers reports a missing component folder, a truncated weights file or a damaged ``config.json`` with
a traceback from deep inside its loaders, and a missing tokenizer folder can even load silently into a
pipeline that samples other images. Each part ``model_index.json`` lists must be a folder; its JSON
files must parse; a model's ``config.json`` must be a mapping whose numbers are numbers in range
(:mod:`flowalign.component_config`: ``num_layers: -5`` would build a model without blocks and drop every
block's weights); a ``.safetensors`` file must be as long as its header says (a cut-off download is
shorter). Only headers are read: the check costs milliseconds on a 20 GB checkpoint. A config whose
sizes do not match its weights is named by :func:`explain_shape_mismatch` once diffusers refuses it.
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

from flowalign.component_config import library_module, read_component_config
from flowalign.errors import UserError

#: JSON files larger than this are not parsed here (none of a component's configs comes close)
MAX_CHECKED_JSON = 64 * 2**20


def check_model_folder(path: str | Path) -> None:
    """Raise ``UserError`` for the first missing or damaged part of the diffusers folder ``path``."""
    folder = Path(path)
    index = json.loads((folder / "model_index.json").read_text())
    for name, entry in index.items():
        if name.startswith("_") or not isinstance(entry, list) or len(entry) != 2 or entry[0] is None:
            continue
        part = folder / name
        if not part.is_dir():
            raise UserError(f"model folder {folder}: {name}/ is missing (model_index.json lists a {entry[1]}); "
                            "restore it from the original download or re-save the model")
        for file in sorted(part.iterdir()):
            if file.suffix == ".json" and file.stat().st_size <= MAX_CHECKED_JSON:
                _check_json(folder, file)
            elif file.suffix == ".safetensors":
                _check_safetensors(folder, file)
        cls = _component_class(*entry)
        if cls is not None and (part / "config.json").is_file():
            read_component_config(folder, name, cls)


def _component_class(library: str, class_name: str) -> type | None:
    """The model class a ``model_index.json`` entry names (None: a scheduler, tokenizer or unknown class)."""
    import torch

    try:
        cls = getattr(library_module(library), class_name, None)
    except ImportError:
        return None  # diffusers names the missing module itself when it loads the folder
    return cls if isinstance(cls, type) and issubclass(cls, torch.nn.Module) else None


#: diffusers' refusal of a weight whose shape is not the one the config builds
_MISMATCH = re.compile(r"because (\S+) expected shape torch\.Size\(\[([^\]]*)\]\), but got torch\.Size\(\[([^\]]*)\]\)")


def explain_shape_mismatch(path: str | Path, err: ValueError) -> str | None:
    """One line naming the component whose ``config.json`` does not match its weights, for diffusers'
    ``ValueError`` about a weight's shape (None for any other error). The component is the one whose
    safetensors header holds that weight at the shape diffusers got (headers only are read)."""
    found = _MISMATCH.search(str(err))
    if found is None:
        return None
    key, expected, got = found.groups()
    folder = Path(path)
    got_shape = [int(x) for x in got.split(",") if x.strip()]
    component = next((f.parent.name for f in sorted(folder.glob("*/*.safetensors"))
                      if _header(f).get(key, {}).get("shape") == got_shape), None)
    where = f"{component}/config.json" if component else "a component's config.json"
    return (f"model folder {folder}: {where} does not match the weights beside it ({key} is [{got}] in the "
            f"weights but the config builds [{expected}]); restore {where} from the original download")


def _header(file: Path) -> dict:
    try:
        with file.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        return header if isinstance(header, dict) else {}
    except (OSError, struct.error, ValueError, UnicodeDecodeError):
        return {}


def _check_json(folder: Path, file: Path) -> None:
    try:
        json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        where = f"line {e.lineno}: {e.msg}" if isinstance(e, json.JSONDecodeError) else "not UTF-8 text"
        raise UserError(f"model folder {folder}: {file.parent.name}/{file.name} is damaged ({where}); "
                        "restore it from the original download") from None


def _check_safetensors(folder: Path, file: Path) -> None:
    """The file holds an 8-byte header length, the JSON header, then the tensors' bytes it lays out."""
    size = file.stat().st_size
    name = f"{file.parent.name}/{file.name}"
    try:
        with file.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > size - 8:
                raise ValueError(f"its header claims {length:,} bytes")
            header = json.loads(f.read(length))
        end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    except (struct.error, ValueError, KeyError, TypeError, IndexError, UnicodeDecodeError) as e:
        raise UserError(f"model folder {folder}: {name} is not a readable safetensors file ({e}); "
                        "restore it from the original download") from None
    if size != 8 + length + end:
        raise UserError(f"model folder {folder}: {name} is {size:,} bytes but its header lays out "
                        f"{8 + length + end:,} (a cut-off download or copy); restore it from the original download")
