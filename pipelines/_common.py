"""Small helpers the SD3, FLUX and Wan policies share (prompt checks, σ → timestep, prompt cache).

Kept deliberately thin: everything model-specific stays in the family files.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from flowalign.errors import UserError
from pipelines.tiny import read_sampling_defaults



def check_prompts(prompts: Any) -> list[str]:
    """``prompts`` must be a non-empty list (or tuple) of str: a bare str would be split into letters."""
    if isinstance(prompts, str):
        raise UserError(f"prompts must be a list of strings, got the str {prompts[:40]!r}: wrap it as [prompt]")
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise UserError(f"prompts must be a non-empty list of strings, got {prompts!r:.60}")
    bad = sorted({type(p).__name__ for p in prompts if not isinstance(p, str)})
    if bad:
        raise UserError(f"prompts must hold only strings, found {', '.join(bad)}")
    return list(prompts)


def sigma_batch(sigma: float | torch.Tensor, batch: int, device: torch.device) -> torch.Tensor:
    """σ as a float32 ``(B,)`` tensor on ``device`` (σ a float, a 0-d or a ``(B,)`` tensor)."""
    s = torch.as_tensor(sigma, dtype=torch.float32, device=device).flatten()
    if s.numel() == 1:
        s = s.expand(batch)
    if s.numel() != batch:
        raise ValueError(f"sigma has {s.numel()} values for a batch of {batch}")
    return s


def sampling_defaults(path: str | Path) -> dict[str, Any]:
    """The folder's ``flowalign.json`` (sampling defaults) without its ``family`` tag and null values."""
    try:
        data = read_sampling_defaults(path) or {}
    except json.JSONDecodeError as err:
        raise UserError(f"{Path(path) / 'flowalign.json'} is not valid JSON ({err}): fix or delete it") from err
    return {k: v for k, v in data.items() if k != "family" and v is not None}


class PromptCache:
    """Per-prompt text embeddings, least recently used evicted beyond ``max_size`` prompts.

    Training reuses a prompt set over and over; the text encoders (T5-XXL for SD3/FLUX, UMT5 for Wan)
    cost more than a transformer step, so each prompt string is encoded once. Rows are stored on the
    policy's device in the model dtype (SD3.5: ~2.7 MB per prompt in bf16).

    Each new prompt is encoded on its own (a batch of one), so its embedding is a function of the string
    alone. Float kernels are not batch-invariant: batched with other prompts, the same prompt can come
    out different in the last bits, and a run resumed from a checkpoint first meets a prompt in another
    batch than the uninterrupted run did, which broke bit-identical resume
    (tests/flowalign/trainers/test_resume.py) when new prompts were encoded 32 at a time.
    """

    def __init__(self, max_size: int = 1024) -> None:
        self.max_size = max_size
        self.rows: OrderedDict[str, dict[str, torch.Tensor]] = OrderedDict()

    def lookup(
        self, prompts: list[str], encode: Callable[[list[str]], dict[str, torch.Tensor]]
    ) -> dict[str, dict[str, torch.Tensor]]:
        """Rows for every distinct prompt; ``encode([prompt]) -> {name: (1, ...)}`` runs on each missing one.

        Returned rows are per prompt, without a batch dimension.
        """
        wanted = list(dict.fromkeys(prompts))
        missing = [p for p in wanted if p not in self.rows]
        found = {p: self.rows[p] for p in wanted if p in self.rows}
        for p in missing:
            with torch.no_grad():
                out = encode([p])
            found[p] = {k: v[0] for k, v in out.items()}
        for p in wanted:
            self.rows[p] = found[p]
            self.rows.move_to_end(p)
        while len(self.rows) > self.max_size:
            self.rows.popitem(last=False)
        return found


def stack_rows(rows: dict[str, dict[str, torch.Tensor]], prompts: list[str], keys: list[str]) -> dict[str, torch.Tensor]:
    """``{key: (B, ...)}`` from per-prompt rows, in the order of ``prompts``."""
    return {k: torch.stack([rows[p][k] for p in prompts]) for k in keys}
