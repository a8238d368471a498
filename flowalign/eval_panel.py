"""Summaries of an evaluation on any rewards: per-reward means with 95% confidence intervals, and
accuracy per prompt tag.

A panel (``flowalign evaluate --reward ...``, ``eval.rewards``) is a :class:`flowalign.reward_set.RewardSet`
scored on one evaluation's samples; every statistic is over the samples a reward scored validly (an
invalid sample, e.g. a dead remote reward, is left out and counted in ``<name>/valid_fraction``, never
averaged in as 0).
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

import torch

#: the confidence level of every interval this module reports
CONFIDENCE = 0.95


def mean_ci(values: list[float]) -> tuple[float, float, float]:
    """``(mean, low, high)``: the mean and its 95% Student-t interval (NaN for an empty list; the interval
    is the mean itself for a single value)."""
    n = len(values)
    if n == 0:
        return math.nan, math.nan, math.nan
    mean = sum(values) / n
    if n == 1:
        return mean, mean, mean
    from scipy.stats import t

    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = float(t.ppf(0.5 + CONFIDENCE / 2, n - 1)) * sd / math.sqrt(n)
    return mean, mean - half, mean + half


def reward_metrics(name: str, values: torch.Tensor, ok: torch.Tensor) -> dict[str, float]:
    """``<name>`` (mean over valid samples), ``<name>/ci95_low``, ``<name>/ci95_high``, ``<name>/valid_fraction``."""
    mean, low, high = mean_ci(values[ok].tolist())
    return {name: mean, f"{name}/ci95_low": low, f"{name}/ci95_high": high,
            f"{name}/valid_fraction": ok.float().mean().item() if len(ok) else math.nan}


def tag_accuracy(values: torch.Tensor, ok: torch.Tensor, metadata: list[dict[str, Any]]) -> dict[str, float]:
    """``accuracy/<tag>``: the mean of ``values`` ``(N,)`` over each metadata ``tag``'s prompts (an invalid
    sample counts as failed, as GenEval counts an unreadable image), and ``accuracy/overall``, the mean over
    tags (GenEval's overall score). Empty unless every prompt has a string ``tag``. Give a reward's verdicts
    (``RewardScores.passed``) where it has them: a partial score's mean is not an accuracy."""
    tags = [m.get("tag") if isinstance(m, dict) else None for m in metadata]
    if not tags or not all(isinstance(t, str) for t in tags):
        return {}
    per: dict[str, list[float]] = defaultdict(list)
    for tag, value, good in zip(tags, values.tolist(), ok.tolist()):
        per[tag].append(float(value) if good else 0.0)
    out = {f"accuracy/{tag}": sum(v) / len(v) for tag, v in sorted(per.items())}
    out["accuracy/overall"] = sum(out.values()) / len(out)
    return out


def score_panel(panel: Any, samples: torch.Tensor, prompts: list[str],
                metadata: list[dict[str, Any]]) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """Score ``samples`` with every reward of ``panel`` (a reward's failure masks its samples, see
    :meth:`RewardSet.score`). Returns the metrics of each reward (:func:`reward_metrics`) and, per sample,
    ``{"scores": {name: value or None}}``, ``{"passed": {name: verdict}}`` for the rewards that give verdicts
    (``<name>/accuracy`` in the metrics) and, for a sample some reward found invalid, ``panel_reason``."""
    scored = panel.score(samples, prompts, metadata)
    metrics: dict[str, float] = {}
    for m, name in enumerate(scored.names):
        metrics.update(reward_metrics(name, scored.values[:, m], scored.ok[:, m]))
        if name in scored.passed:
            metrics[f"{name}/accuracy"] = scored.passed[name].float().mean().item()
    rows = []
    for i in range(len(prompts)):
        row: dict[str, Any] = {"scores": {name: float(scored.values[i, m]) if scored.ok[i, m] else None
                                          for m, name in enumerate(scored.names)}}
        if scored.passed:
            row["passed"] = {name: bool(verdicts[i]) for name, verdicts in scored.passed.items()}
        if any(texts[i] for texts in scored.notes.values()):  # e.g. failure causes, shown by galleries
            row["notes"] = {name: texts[i] for name, texts in scored.notes.items() if texts[i]}
        if not scored.valid[i] and scored.reasons:
            row["panel_reason"] = scored.reasons[i]  # "<reward>: <why>", the first invalid reward's
        rows.append(row)
    return metrics, rows
