"""The OCR reward's score and target, as Flow-GRPO computes them (``flow_grpo/ocr.py``).

Both texts are lower-cased and spaces removed (the recognised text also loses its line breaks: Flow-GRPO
joins PaddleOCR's lines with nothing between them). The score is 1 when the target appears anywhere in
the recognised text, else ``1 - min(d, n) / n`` with ``d`` the Levenshtein distance between the whole
recognised text and the target and ``n`` the target's length: unrelated extra text costs at most the
target's length, so the score stays in [0, 1].
"""

from __future__ import annotations

import re
from typing import Any

# the first quoted span: "...", “...” or '...' (a single quote only where it is not an apostrophe)
_QUOTED = re.compile(r'"([^"]+)"|“([^”]+)”|(?<!\w)\'([^\']+)\'(?!\w)')


def target_text(prompt: str, metadata: dict[str, Any] | None = None) -> str | None:
    """The text a prompt asks to render: ``metadata["text"]`` when given, else its first quoted span
    (None when it has neither)."""
    if metadata and isinstance(metadata.get("text"), str) and metadata["text"].strip():
        return metadata["text"]
    match = _QUOTED.search(prompt)
    return next((g for g in match.groups() if g), None) if match else None


def normalise(text: str) -> str:
    """Lower case without spaces or line breaks (what both sides are compared as)."""
    return re.sub(r"\s+", "", text).lower()


def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance (insertions, deletions and substitutions all cost 1)."""
    if len(a) < len(b):
        a, b = b, a
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        current = [i]
        for j, cb in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb)))
        previous = current
    return previous[-1]


def ocr_score(recognised: str, target: str) -> float:
    """Flow-GRPO's OCR reward of ``recognised`` text for ``target`` (see the module docstring); the target
    must hold a non-space character."""
    seen, wanted = normalise(recognised), normalise(target)
    if not wanted:
        raise ValueError("the OCR target is empty")
    distance = 0 if wanted in seen else edit_distance(seen, wanted)
    return 1.0 - min(distance, len(wanted)) / len(wanted)
