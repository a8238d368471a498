"""Hashes the VLM reward known answers (``known_answers/hpsv3_reference.json``, ``videoalign_reference.json``) pin:
the tensors of the tiny folder their reference code scored, and the token ids it was given."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path

import torch


def tensors_sha256(paths: Iterable[Path]) -> str:
    """SHA-256 over the tensors of the files (``.safetensors`` or ``torch.save``d dicts): each key, sorted, then
    its tensor's bytes. Independent of the file format's own layout."""
    state: dict[str, torch.Tensor] = {}
    for path in paths:
        if str(path).endswith(".safetensors"):
            from safetensors.torch import load_file

            state.update(load_file(path))
        else:
            state.update(torch.load(path, map_location="cpu", weights_only=True))
    h = hashlib.sha256()
    for key in sorted(state):
        h.update(key.encode())
        h.update(state[key].contiguous().numpy().tobytes())
    return h.hexdigest()


def ids_sha256(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> list[str]:
    """One SHA-256 a row: its unpadded token ids written as comma-separated decimals."""
    return [hashlib.sha256(",".join(map(str, ids[mask.bool()].tolist())).encode()).hexdigest()
            for ids, mask in zip(input_ids, attention_mask)]
