"""UnifiedReward-Flex's pairwise judgement: ``unified_reward`` with ``mode: flex_pairwise``
(docs/methods/vlm_reward_models.md), the judge of Pref-GRPO's UnifiedReward-Flex recipes.

Each pair of images sharing a prompt is shown to the judge with UnifiedReward-Flex's image template (CodeGoat24/
Pref-GRPO @ 3e787f6, ``fastvideo/rewards/templates.py``, verbatim below). The reply is a JSON object naming an
overall ``winner`` and, per category (semantic alignment, quality, aesthetics, ...), a ``cat_winner``. As
Pref-GRPO's ``fastvideo/rewards/unifiedreward_flex.py`` (``_pairwise_win_rate``) reads it:

- the reply is parsed as JSON, else its first ``{`` to last ``}``; a winner is "Image 1" or "Image 2" named
  alone (``\\b(?:video|image)\\s*k\\b``, any case), anything else a tie (half a win each);
- overall: each image's share of won comparisons, rounded to 3 decimals;
- categories: the first three of each parsed reply, keyed by name in the order first seen (a category named
  "overall" counts toward the overall shares, as theirs); a sample's dimension score is the mean of its
  categories' shares weighted by ``category_weights`` in that order (missing weights 1), rounded to 3;
- the reward: ``(w_o·overall + w·dim_mean) / (w_o + w)`` where the sample has a category and ``w`` > 0, else
  ``overall``. In their code ``w`` is not the configured ``dim_weight``: the per-sample loop over the categories
  rebinds that name, so the blend reads the last category's weight (``dim_weight`` only where no reply named a
  category). ``flex_blend: code`` (the default) computes that; ``as_set`` blends with ``dim_weight``, as the
  docstring of their weights intends. Their ``--apply_gdpo`` blend of the advantages reads ``dim_weight`` itself
  (:func:`flowalign.advantages.per_reward_win_rate_advantages`), so Pref-GRPO's recipes train the same either way.

A failed request is left out (theirs stops on it); a sample none of whose comparisons came back is invalid.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Sequence

FLEX_QUESTION = """## Identity
You are a top-tier AI Image Content Evaluation Expert. Your task is to perform a hierarchical, multi-dimensional comparative analysis of Image 1 and Image 2 based on the provided Prompt.

## Evaluation Framework

### 1. Mandatory Starting Categories
For every evaluation, you MUST address these three core areas, but you should **independently define 3-5 sub-dimensions** for each based on what makes the images distinct:
- **A. Semantic Alignment & Accuracy**: Evaluate how well the images capture the prompt's subjects, actions, and constraints.
- **B. Image Quality & Realism**: Evaluate technical execution, physical logic, and visual clarity.
- **C. Aesthetics & Artistry**: Evaluate artistic appeal, color harmony, and compositional mastery.
*Note: If the prompt involves unique traits, you are encouraged to add a personalized Category D.*

### 2. Scoring & Reasoning Rules
- **Dynamic Dimensions**: Do not rely on a fixed list. Choose sub-dimensions that best highlight the differences between the two images.
- **Sum-of-10 Constraint**: For every sub-dimension, the scores for Image 1 and Image 2 MUST total exactly 10 (e.g., 8+2, 5+5).
- **Evidence-Based Reasoning**: Provide professional, critical analysis for each score. Avoid generic praise; point out specific visual evidence.

## Input Data
**Prompt:** [{prompt}]

**Content to be Evaluated:**
[Image 1] 
[Image 2] 

## Output Format
Output the results as a single, complete JSON object.

```json
{{
  "prompt": "[Original Prompt]",
  "categories": [
    {{
      "name": "[Category Name]",
      "dims": [
        {{
          "name": "[Custom Sub-dimension]",
          "reason_1": "[Specific evidence]",
          "reason_2": "[Specific evidence]",
          "score_1": 0-10,
          "score_2": 0-10
        }}
      ],
      "cat_reason": "[Category-level analysis]",
      "cat_winner": "Image 1/2"
    }}
  ],
  "reason": "[Overall analysis]",
  "winner": "Image 1/2"
}}
"""

_WINNER = {k: re.compile(r"\b(?:video|image)\s*%d\b" % k) for k in (1, 2)}
_OBJECT = re.compile(r"\{.*\}", re.DOTALL)


def _json_object(text: str | None) -> dict | None:
    """The reply as a JSON object: the whole stripped text, else its first ``{`` to last ``}``; None otherwise."""
    if not text:
        return None
    text = text.strip()
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        found = _OBJECT.search(text)
        try:
            data = json.loads(found.group(0)) if found else None
        except json.JSONDecodeError:
            data = None
    return data if isinstance(data, dict) else None


def winner(text: str) -> int | None:
    """1 or 2 when the text names "image 1" / "image 2" (or "video k") and not the other, any case; else None."""
    lowered = text.lower()
    first, second = _WINNER[1].search(lowered), _WINNER[2].search(lowered)
    return 1 if first and not second else 2 if second and not first else None


@dataclass(frozen=True)
class FlexVerdict:
    """One reply read: the overall ``winner`` (None: a tie) and ``categories``, ``(name, winner)`` of the first
    three, None when the reply is not a JSON object."""

    winner: int | None
    categories: tuple[tuple[str, int | None], ...] | None


def parse_flex(text: str | None) -> FlexVerdict:
    """What a UnifiedReward-Flex reply says (see the module docstring)."""
    data = _json_object(text)
    if data is None:
        return FlexVerdict(None, None)
    categories = data.get("categories", [])
    cats = tuple((str(c.get("name", "")).strip() or "category", winner(str(c.get("cat_winner", ""))))
                 for c in (categories[:3] if isinstance(categories, list) else []) if isinstance(c, dict))
    return FlexVerdict(winner(str(data.get("winner", ""))), cats)


@dataclass
class FlexRates:
    """Per sample: ``overall`` share (None: no comparison read), ``dim_mean`` (0 without categories),
    ``has_dims``, ``reward`` (None where ``overall`` is) and ``read`` comparisons."""

    overall: list[float | None]
    dim_mean: list[float]
    has_dims: list[bool]
    reward: list[float | None]
    read: list[int]


#: how the reward blends the overall and category win rates: their code's or the configured dimension weight
FLEX_BLENDS = {"code": "Pref-GRPO's code: the last category's weight where a reply named categories",
               "as_set": "the configured dim_weight"}


def flex_win_rates(n: int, verdicts: Sequence[tuple[int, int, FlexVerdict | None]], *, overall_weight: float,
                   dim_weight: float, category_weights: Sequence[float] | None, blend: str = "code") -> FlexRates:
    """Pref-GRPO's ``_pairwise_win_rate`` over ``verdicts`` ``(a, b, verdict)`` of samples ``0..n-1`` (a verdict
    None: the request failed, not counted); ``blend``: one of :data:`FLEX_BLENDS`."""
    wins: dict[str, list[float]] = {"overall": [0.0] * n}
    counts: dict[str, list[int]] = {"overall": [0] * n}
    order: list[str] = []

    def count(key: str, a: int, b: int, won: int | None) -> None:
        wins.setdefault(key, [0.0] * n)
        counts.setdefault(key, [0] * n)
        counts[key][a] += 1
        counts[key][b] += 1
        if won is None:
            wins[key][a] += 0.5
            wins[key][b] += 0.5
        else:
            wins[key][a if won == 1 else b] += 1

    for a, b, verdict in verdicts:
        if verdict is None:
            continue
        count("overall", a, b, verdict.winner)
        for name, won in verdict.categories or ():
            if name not in order:
                order.append(name)
            count(name, a, b, won)
    dims = [k for k in order if k != "overall"]
    given = list(category_weights or [])
    weights = (given + [1.0] * len(dims))[: len(dims)] if given else [1.0] * len(dims)
    overall = [round(wins["overall"][i] / counts["overall"][i], 3) if counts["overall"][i] else None
               for i in range(n)]
    # their loop ``for dim_key, dim_weight in zip(dim_keys, weights)`` leaves the last category's weight in the
    # name the blend reads
    blend_weight = weights[-1] if blend == "code" and dims else dim_weight
    dim_mean, has_dims, reward = [], [], []
    for i in range(n):
        rates = [(wins[k][i] / counts[k][i], w) for k, w in zip(dims, weights) if counts[k][i] > 0]
        total = sum(w for _, w in rates)
        mean = (sum(r * w for r, w in rates) / total if total > 0 else sum(r for r, _ in rates) / len(rates)) \
            if rates else 0.0
        dim_mean.append(round(float(mean), 3) if rates else 0.0)
        has_dims.append(bool(rates))
        if overall[i] is None:
            reward.append(None)
        elif blend_weight > 0 and rates:
            reward.append((overall_weight * overall[i] + blend_weight * dim_mean[i]) / (overall_weight + blend_weight))
        else:
            reward.append(overall[i])
    return FlexRates(overall, dim_mean, has_dims, reward, counts["overall"])
