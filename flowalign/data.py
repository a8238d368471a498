"""Prompt data: a text or JSONL file of prompts (with optional per-prompt metadata), or a benchmark's tasks.

Batches are a pure function of (seed, step): resuming needs no data-loader state, and every rank can
compute its own slice of the same global batch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from flowalign.errors import UserError
from flowalign.limits import MAX_PROMPT_CHARS


@dataclass
class PromptSet:
    prompts: list[str]
    metadata: list[dict[str, Any]]

    def __len__(self) -> int:
        return len(self.prompts)

    def batch_indices(self, seed: int, step: int, size: int) -> list[int]:
        """Indices of the ``size`` prompts of a global step: epoch-wise permutations, no repeats within an epoch."""
        n = len(self.prompts)
        out = []
        for pos in range(step * size, (step + 1) * size):
            epoch, offset = divmod(pos, n)
            perm = np.random.default_rng([seed, epoch]).permutation(n)
            out.append(int(perm[offset]))
        return out


def check_prompt_length(prompt: str, where: str) -> None:
    """Refuse a prompt longer than :data:`flowalign.limits.MAX_PROMPT_CHARS` (``where`` names it: a file's
    line, an option): text encoders read a few thousand characters at most, and tokenising megabytes
    would spend memory and minutes on text that is cut off anyway."""
    if len(prompt) > MAX_PROMPT_CHARS:
        raise UserError(f"{where}: a prompt of {len(prompt):,} characters ({prompt[:30]!r}...); give at most "
                        f"{MAX_PROMPT_CHARS:,} (text encoders read only the first few thousand)")


class _RepeatedKey(Exception):
    """A JSON object names a key twice (``json`` would silently keep the last value)."""


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json.loads``' ``object_pairs_hook``: the object, refusing a key given twice."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _RepeatedKey(key)
        out[key] = value
    return out


def read_prompt_file(path: str | Path) -> PromptSet:
    """``.txt``: one prompt a line; ``.jsonl``: ``{"prompt": ..., <metadata>...}`` a line (e.g. a VVR ``task``).

    A JSONL ``image`` field (the input image of an editing or image-to-video prompt) is a path relative to the
    file; it is stored resolved in the prompt's metadata. A line may give ``{"prompts": [...]}`` instead of a
    prompt (LongLive's interactive prompt files): the prompt segments of a video that switches prompts, the
    first of them its prompt, all of them kept in the metadata.
    """
    from flowalign.config import read_text_file

    path = Path(path)
    text = read_text_file(path, "prompt file", "a .txt (one prompt a line) or .jsonl file")
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        raise UserError(f"prompt file {path} is empty")
    if path.suffix == ".jsonl":
        prompts, metadata = [], []
        for i, line in enumerate(lines, 1):
            try:
                row = json.loads(line, object_pairs_hook=_unique_keys)
            except json.JSONDecodeError as e:
                raise UserError(f"{path}:{i}: not valid JSON ({e.msg})") from None
            except _RepeatedKey as e:
                raise UserError(f"{path}:{i}: key {e.args[0]!r} is given twice in one object; keep one") from None
            if isinstance(row, dict) and "prompt" not in row and "prompts" in row:
                segments = row["prompts"]
                if not isinstance(segments, list) or not segments or not all(isinstance(p, str) for p in segments):
                    raise UserError(f'{path}:{i}: "prompts" must be a non-empty list of prompt strings (the '
                                    "segments of a video that switches prompts)")
                for segment in segments:
                    check_prompt_length(segment, f"{path}:{i}")
                row["prompt"] = segments[0]
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
                raise UserError(f'{path}:{i}: each line needs a "prompt" string (or a "prompts" list of segments)')
            check_prompt_length(row["prompt"], f"{path}:{i}")
            prompts.append(row.pop("prompt"))
            if "image" in row:  # an input image (editing, image-to-video), relative to the file
                if not isinstance(row["image"], str) or not row["image"]:
                    raise UserError(f'{path}:{i}: "image" must be a path string relative to {path.name}, '
                                    f'got {row["image"]!r}')
                row["image"] = str((path.parent / row["image"]).resolve())
            metadata.append(row)
        return PromptSet(prompts, metadata)
    prompts = [line.strip() for line in lines]
    for i, prompt in enumerate(prompts, 1):
        check_prompt_length(prompt, f"{path}: prompt {i}")
    return PromptSet(prompts, [{} for _ in lines])
