"""Reading a VLM judge's answers: text scores, next-token score distributions and JSON rubrics.

Pure functions on strings and ``{token_text: logprob}`` dicts, shared by the local judge and the
HTTP client (``docs/methods/vlm_judges.md``). A failure is returned as ``(None, reason)``, never as a
score of 0 and never as an exception: the caller marks the sample invalid.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

_NUMBER = r"(-?\d+(?:\.\d+)?)"
# "7/10" or "7 / 10" or "7 out of 10": a score written as a fraction of the scale's top
_FRACTION = re.compile(_NUMBER + r"\s*(?:/|out of)\s*" + _NUMBER, re.I)
_THINK = re.compile(r"<think>.*?(?:</think>|$)", re.S | re.I)
_ANSWER = re.compile(r"<answer>(.*?)(?:</answer>|$)", re.S | re.I)


@dataclass
class ParsedScore:
    """``score`` (mean of the labels found, or the fallback number), ``values`` per label, or a ``reason``."""

    score: float | None
    values: dict[str, float]
    reason: str = ""

    @property
    def ok(self) -> bool:
        return self.score is not None


def _label_pattern(label: str) -> re.Pattern[str]:
    # "Alignment Score (1-5): 4", "**Alignment**: 4/5", "alignment = 4", "Alignment score is 4"
    name = r"\s+".join(re.escape(w) for w in label.split())
    return re.compile(
        r"(?<![A-Za-z])" + name + r"(?:[\s*_]+score)?[\s*_]*(?:\(\s*[\d.]+\s*(?:-|–|~|to)\s*[\d.]+\s*\))?"
        r"[\s*_]*(?::|=|is|-)[\s*_]*" + _NUMBER + r"(?:\s*(?:/|out of)\s*" + _NUMBER + ")?",
        re.I,
    )


def _value(number: str, denominator: str | None, hi: float) -> float:
    x = float(number)
    # "7/10" on a 1-10 scale is 7; "0.7/1" on a 1-10 scale is a fraction of the top
    if denominator is not None and float(denominator) not in (0.0, hi):
        x = x / float(denominator) * hi
    return x


def answer_region(text: str) -> str:
    """The part of a reply that holds the verdict: the ``<answer>`` block if any, without ``<think>``."""
    answer = _ANSWER.search(text)
    if answer:
        return answer.group(1)
    return _THINK.sub(" ", text)


def parse_score(text: str | None, labels: tuple[str, ...] | list[str] = ("Score",),
                scale: tuple[float, float] = (1, 5), *, require_all: bool = False) -> ParsedScore:
    """A generated judge reply → score on ``scale`` (inclusive), or the reason it has none.

    1. Reasoning in ``<think>…</think>`` is dropped; an ``<answer>…</answer>`` block, if present, is
       the only place read.
    2. Each label is looked for as ``<label> [Score] [(lo-hi)] : x[/hi]`` (case-insensitive, markdown
       emphasis allowed). The score is the mean of the labels found (``require_all``: all must be).
    3. No label found: the first number in the region (``x/hi`` fractions read as ``x``) [UnifiedReward].
    4. A value outside ``scale`` is a failure, not a clipped score.
    """
    lo, hi = scale
    if text is None or not text.strip():
        return ParsedScore(None, {}, "empty reply")
    region = answer_region(text)
    values: dict[str, float] = {}
    for label in labels:
        m = _label_pattern(label).search(region)
        if m:
            values[label] = _value(m.group(1), m.group(2), hi)
    if require_all and len(values) < len(labels):
        missing = [lab for lab in labels if lab not in values]
        return ParsedScore(None, values, f"no score for {missing} in {_clip(text)!r}")
    if values:
        bad = {k: v for k, v in values.items() if not lo <= v <= hi}
        if bad:
            return ParsedScore(None, values, f"score(s) {bad} outside [{lo:g}, {hi:g}]")
        return ParsedScore(sum(values.values()) / len(values), values)
    frac = _FRACTION.search(region)
    first = re.search(_NUMBER, region)
    if first is None:
        return ParsedScore(None, {}, f"no number in {_clip(text)!r}")
    if frac and frac.start() == first.start():
        x = _value(frac.group(1), frac.group(2), hi)
    else:
        x = float(first.group(1))
    if not lo <= x <= hi:
        return ParsedScore(None, {}, f"score {x:g} outside [{lo:g}, {hi:g}] in {_clip(text)!r}")
    return ParsedScore(x, {"fallback": x})


def _clip(text: str, n: int = 80) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 1] + "…"


# ------------------------------------------------------------------------------------------------
# Probability-weighted scores from next-token log-probabilities
# ------------------------------------------------------------------------------------------------


def choice_probs(positions: list[list[tuple[str, float]]], chosen: list[str], choices: list[str]
                 ) -> tuple[list[float] | None, float, str]:
    """Probabilities of the single-token answers ``choices`` at the reply's start, renormalised.

    ``positions[i]`` lists ``(token text, log-prob)`` alternatives (top-N) at generated position ``i``;
    ``chosen[i]`` is the token greedy decoding took there. An answer token matches a choice when its
    text, stripped of whitespace and compared case-insensitively, equals it, so ``"7"`` and ``" 7"``
    (the leading-space variant) pool their mass. When the first token was whitespace alone (Qwen
    writes ``"Score: 7"`` as ``":" "Ġ" "7"``) the answer is read one position later too, weighted by
    that whitespace's probability: ``P(k) ∝ P₀(k) + P₀(␣)·P₁(k)`` [derived]. Choices outside the top-N
    count as 0; the mass found before renormalising is returned so callers can report it.
    Returns ``(probs | None, mass, reason)``.
    """
    keys = [c.strip().lower() for c in choices]
    mass = [0.0] * len(choices)
    weight = 1.0
    for i, top in enumerate(positions[:2]):
        for token, logprob in top:
            t = token.strip().lower()
            if t in keys and math.isfinite(logprob):
                mass[keys.index(t)] += weight * math.exp(logprob)
        taken = [lp for t, lp in top if i < len(chosen) and t == chosen[i]]
        if not (taken and chosen[i] and not chosen[i].strip()):
            break
        weight *= math.exp(max(taken))  # continue past a whitespace-only token
    total = sum(mass)
    if not total > 0:
        return None, 0.0, f"none of {choices} among the judge's top next tokens (first: {chosen[:1]!r})"
    return [m / total for m in mass], total, ""


def choice_from_text(text: str | None, choices: list[str]) -> tuple[list[float] | None, str]:
    """The first of ``choices`` written as a word in a reply (for servers that give no log-probs) → one-hot."""
    if not text:
        return None, "empty reply"
    pattern = r"(?<![\w.])(" + "|".join(re.escape(c) for c in choices) + r")(?![\w]|\.\d)"
    m = re.search(pattern, answer_region(text), re.I)
    if m is None:
        return None, f"none of {choices} in {_clip(text)!r}"
    keys = [c.lower() for c in choices]
    return [float(k == m.group(1).lower()) for k in keys], ""


def weighted_score(probs: list[float]) -> float:
    """``s = Σ k·p_k`` over ``k = 1..K`` for ``probs = [p_1, ..., p_K]``."""
    return float(sum((k + 1) * p for k, p in enumerate(probs)))


# ------------------------------------------------------------------------------------------------
# Rubrics (Thinking Reward Model pattern)
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Criterion:
    name: str
    description: str
    weight: float


def parse_rubric(text: str | None, max_criteria: int = 8) -> tuple[list[Criterion] | None, str]:
    """A judge's JSON rubric → criteria with weights summing to 1, or ``(None, reason)``.

    Accepts a JSON list of ``{name, description, weight}`` or an object holding one under
    ``criteria``/``rubric``, anywhere in the reply (code fences and prose around it are ignored).
    Weights that do not sum to 1 are renormalised; missing weights are equal [derived].
    """
    if not text:
        return None, "empty rubric reply"
    region = answer_region(text)
    data: Any = None
    for opener, closer in (("[", "]"), ("{", "}")):
        start, end = region.find(opener), region.rfind(closer)
        if 0 <= start < end:
            try:
                data = json.loads(region[start : end + 1])
                break
            except json.JSONDecodeError:
                continue
    if isinstance(data, dict):
        data = data.get("criteria", data.get("rubric"))
    if not isinstance(data, list) or not data:
        return None, f"no JSON list of criteria in {_clip(text)!r}"
    items = []
    for entry in data[:max_criteria]:
        if not isinstance(entry, dict) or not str(entry.get("name", "")).strip():
            return None, f"criterion without a name: {_clip(json.dumps(entry))!r}"
        w = entry.get("weight", None)
        try:
            w = None if w is None else float(w)
        except (TypeError, ValueError):
            return None, f"criterion {entry['name']!r} has weight {w!r}, not a number"
        if w is not None and (not math.isfinite(w) or w < 0):
            return None, f"criterion {entry['name']!r} has weight {w}, not >= 0"
        items.append((str(entry["name"]).strip(), str(entry.get("description", "")).strip(), w))
    if len({n.lower() for n, _, _ in items}) < len(items):
        return None, "criteria names repeat"
    weights = [1.0 if w is None else w for _, _, w in items]
    total = sum(weights)
    if not total > 0:
        return None, "criteria weights sum to 0"
    return [Criterion(n, d, w / total) for (n, d, _), w in zip(items, weights)], ""


def rubric_reward(criteria: list[Criterion], scores: dict[str, float], top: float = 10.0) -> float:
    """``R = Σ_k w_k · s_k / top`` (scores per criterion on 0..top, weights summing to 1)."""
    return float(sum(c.weight * scores[c.name] / top for c in criteria))


@dataclass
class ParsedThinking:
    """A thinking judge's reply: its ``assessment`` text and final ``score`` (0..10), or a ``reason``."""

    score: float | None
    assessment: str
    reason: str = ""

    @property
    def ok(self) -> bool:
        return self.score is not None


_ASSESSMENT = re.compile(r"(?<![A-Za-z])[*_#\s]*assessment[*_\s]*:", re.I)


def parse_thinking(text: str | None, top: float = 10.0) -> ParsedThinking:
    """A TRM-style reply (assessment against the rubric, then the verdict) → score on ``[0, top]``.

    The assessment is the ``<think>…</think>`` block or the text after an ``Assessment:`` heading; the
    verdict is the *last* ``Score: x`` after it. A reply without an assessment, without a final score, or
    with one outside ``[0, top]`` has no score: the reasoning is the point of the mode, and the first
    number of a free-text assessment (``parse_score``'s fallback) is not a verdict.
    """
    if text is None or not text.strip():
        return ParsedThinking(None, "", "empty reply")
    think = re.search(r"<think>(.*?)</think>", text, re.S | re.I)
    if think:
        assessment, rest = think.group(1), text[think.end():]
    else:
        heading = _ASSESSMENT.search(text)
        if heading is None:
            return ParsedThinking(None, "", f"no assessment (an 'Assessment:' section or <think>) in {_clip(text)!r}")
        assessment = rest = text[heading.end():]
    verdicts = list(_label_pattern("Score").finditer(rest))
    if not verdicts:
        return ParsedThinking(None, assessment.strip(), f"no final 'Score: x' after the assessment in {_clip(text)!r}")
    last = verdicts[-1]
    if not think:
        assessment = rest[: last.start()]
    assessment = assessment.strip()
    if not re.search(r"[A-Za-z]{2,}", assessment):
        return ParsedThinking(None, assessment, f"the assessment before the score is empty in {_clip(text)!r}")
    x = _value(last.group(1), last.group(2), top)
    if not 0 <= x <= top:
        return ParsedThinking(None, assessment, f"score {x:g} outside [0, {top:g}]")
    return ParsedThinking(x, assessment)



@dataclass
class ParsedChecklist:
    """A TRM checkpoint's JSON verdict: ``score`` (``final_score`` clamped to 0..10), the whole ``data``
    (``eval_points``, ``dimension_summary``, ``score_reason``), or a ``reason``."""

    score: float | None
    data: dict[str, Any]
    reason: str = ""

    @property
    def ok(self) -> bool:
        return self.score is not None


_THINK_BLOCK = re.compile(r"<think\b[^>]*>.*?</think\s*>", re.S | re.I)


def parse_checklist(text: str | None, top: float = 10.0) -> ParsedChecklist:
    """A reply in the Thinking Reward Model's released format → its ``final_score`` on ``[0, top]``.

    As the authors' reader (``trm.utils.parse_reward_json``): closed ``<think>`` blocks are dropped and a
    markdown code fence around the JSON is removed; the reply must be one JSON object, or hold one between
    its first ``{`` and its last ``}``; ``final_score`` (a number or a numeric string) is clamped to
    ``[0, top]``. Where theirs raises, the sample has no score (``reason``). One deliberate difference: a
    non-finite ``final_score`` (``NaN``, ``Infinity``) has no score here, where their clamp turns NaN into
    ``top`` (``tests/rewards/known_answers/trm_checklist_parse.json``).
    """
    raw = _THINK_BLOCK.sub("", (text or "").strip()).strip()
    if raw.startswith("```"):
        raw = re.sub(r"\s*```$", "", re.sub(r"^```(?:json)?\s*", "", raw))
    raw = raw.strip()
    if not raw:
        return ParsedChecklist(None, {}, "empty reply")
    try:
        data = json.loads(raw)
    except json.JSONDecodeError:
        span = re.search(r"\{.*\}", raw, re.S)
        try:
            data = json.loads(span.group(0)) if span else None
        except json.JSONDecodeError:
            data = None
        if data is None:
            return ParsedChecklist(None, {}, f"no JSON object in {_clip(raw)!r}")
    if not isinstance(data, dict) or "final_score" not in data:
        return ParsedChecklist(None, data if isinstance(data, dict) else {}, f"no 'final_score' in {_clip(raw)!r}")
    value = data["final_score"]
    try:
        x = float(value)
    except (TypeError, ValueError):
        return ParsedChecklist(None, data, f"final_score {value!r} is not a number")
    if not math.isfinite(x):
        return ParsedChecklist(None, data, f"final_score {value!r} is not finite")
    return ParsedChecklist(max(0.0, min(top, x)), data)
