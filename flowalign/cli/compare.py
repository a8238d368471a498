"""``flowalign compare A B``: paired wins and losses of evaluation B against evaluation A.

Each folder is what ``flowalign evaluate --out`` (or a run's ``evals/step-XXXXXX``) writes. Sample ``i`` of
both got the same noise, so prompt by prompt B wins, ties or loses against A on the verifier's score (or,
with ``--reward NAME``, on that reward of an evaluation with ``--reward``s).
Prints one JSON line: wins / ties / losses over the prompts both scored validly (``unscored``: the others,
an invalid sample on either side, never a tie), the win rate ``(wins + ties/2) / (wins + ties + losses)``,
``wins / (wins + losses)``, a two-sided exact sign test on the decided prompts, both means (over each
side's valid samples), and for continuous scores the
paired difference ``B - A`` (its mean with a 95% interval) and a Wilcoxon signed-rank test. ``--by constraint`` or
``--by shape`` adds one line per group of prompts (the task's constraint types, or the shapes its prompt
names, as the reward lists them): where a change gained and where it lost.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np

from flowalign import strict_json
from flowalign.errors import UserError


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("compare", help="paired wins/losses of evaluation B against evaluation A (same noise)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("a", type=Path, help="evaluation folder A (e.g. the base model)")
    p.add_argument("b", type=Path, help="evaluation folder B (e.g. the fine-tuned model)")
    p.add_argument("--on", choices=("score", "passed"), default="score",
                   help="compare the verifier's score (default) or whether every constraint passed")
    p.add_argument("--reward", default=None, metavar="NAME",
                   help="compare this reward's per-sample scores (an evaluation with --reward NAME, or a run's "
                        "eval.rewards); default: each row's score")
    p.add_argument("--by", choices=("constraint", "shape"), default=None,
                   help="also compare per group of prompts: by the task's constraint types or the shapes it names")
    return p


def read_results(folder: Path) -> list[dict[str, Any]]:
    """The rows of ``folder/results.jsonl`` (one per sample, in prompt order)."""
    path = Path(folder) / "results.jsonl"
    if not path.is_file():
        raise UserError(f"{folder}: no results.jsonl; give a folder written by flowalign evaluate --out or a run's evals/step-XXXXXX")
    rows = []
    for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{path}:{number}: not a complete JSON row ({e.msg}; the file was cut off or edited); "
                            "rerun flowalign evaluate --out for that folder") from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or "score" not in row:
            raise UserError(f"{path}:{number}: a row needs a prompt and a score; give a folder written by "
                            "flowalign evaluate --out")
        rows.append(row)
    return rows


def sign_test_p(wins: int, losses: int) -> float:
    """Two-sided exact sign test of wins against losses (ties left out); 1.0 when nothing was decided."""
    from scipy.stats import binomtest

    return float(binomtest(wins, wins + losses).pvalue) if wins + losses else 1.0


def paired(a: np.ndarray, b: np.ndarray) -> dict[str, Any]:
    """Paired wins / ties / losses of scores ``b`` against ``a`` (``(n,)`` each, same prompts and noise) over
    the pairs both scored (NaN: an invalid sample, ``unscored``, neither a win nor a tie), and the
    differences ``b - a`` over those pairs (:func:`differences`)."""
    both = np.isfinite(a) & np.isfinite(b)
    wins, losses = int((b[both] > a[both]).sum()), int((b[both] < a[both]).sum())
    scored = int(both.sum())
    ties = scored - wins - losses
    return {"n": len(a), "wins": wins, "ties": ties, "losses": losses, "unscored": len(a) - scored,
            "win_rate": (wins + ties / 2) / scored if scored else float("nan"),
            "wins_over_decided": wins / (wins + losses) if wins + losses else float("nan"),
            "sign_test_p": sign_test_p(wins, losses),
            "a_mean": _mean(a), "b_mean": _mean(b),
            **differences(a, b)}


def _mean(values: np.ndarray) -> float:
    """The mean of the valid (finite) values; NaN when there is none."""
    valid = values[np.isfinite(values)]
    return float(valid.mean()) if len(valid) else float("nan")


def differences(a: np.ndarray, b: np.ndarray) -> dict[str, Any]:
    """``mean_diff`` of ``b - a`` with its 95% Student-t interval, and the two-sided Wilcoxon signed-rank
    p-value (zero differences left out; 1.0 when none is left), over the ``n_paired`` pairs both scored."""
    from scipy.stats import wilcoxon

    from flowalign.eval_panel import mean_ci

    both = np.isfinite(a) & np.isfinite(b)
    d = (b - a)[both]
    mean, low, high = mean_ci(d.tolist())
    decided = d[d != 0]
    p = float(wilcoxon(decided).pvalue) if len(decided) else 1.0
    return {"n_paired": int(both.sum()), "mean_diff": mean, "diff_ci95_low": low, "diff_ci95_high": high,
            "wilcoxon_p": p}


def group_of(row: dict[str, Any], by: str) -> str:
    """The constraint types of a result row, or the shapes its task names (rewards that know shapes, such
    as VVR, list them in ``shapes``); "-" for none."""
    if by == "constraint":
        return "+".join(sorted({name for name, _ in row.get("constraints", [])})) or "-"
    return "+".join(sorted(row.get("shapes", []))) or "-"


def scores(rows: list[dict[str, Any]], on: str, reward: str | None = None) -> np.ndarray:
    if on == "passed":
        return np.array([float(bool(r.get("all_passed", False))) for r in rows])
    if reward is not None:
        if not any(reward in (r.get("scores") or {}) for r in rows):
            known = sorted({k for r in rows for k in (r.get("scores") or {})})
            raise UserError(f"--reward {reward}: the evaluation scored no such reward"
                            + (f"; it has {', '.join(known)}" if known else "; evaluate with --reward to score rewards"))
        values = [(r.get("scores") or {}).get(reward) for r in rows]
        return np.array([float("nan") if v is None else float(v) for v in values])
    # an invalid sample's score is written as null (JSON has no NaN); NaN never wins or loses
    return np.array([float("nan") if r["score"] is None else float(r["score"]) for r in rows])


def compare(a_rows: list[dict[str, Any]], b_rows: list[dict[str, Any]], on: str = "score",
            by: str | None = None, reward: str | None = None) -> list[dict[str, Any]]:
    """The overall comparison, then one per group when ``by`` is given."""
    if [r["prompt"] for r in a_rows] != [r["prompt"] for r in b_rows]:
        raise UserError("the two evaluations hold different prompts; evaluate both on the same split, n and seed")
    if reward is not None and on != "score":
        raise UserError("--reward compares a reward's scores; leave out --on passed")
    a, b = scores(a_rows, on, reward), scores(b_rows, on, reward)
    if len(a) and not (np.isfinite(a) & np.isfinite(b)).any():
        what = f"reward {reward}" if reward else "score"
        raise UserError(f"no prompt has a valid {what} in both evaluations (A: {int(np.isfinite(a).sum())} of "
                        f"{len(a)} valid, B: {int(np.isfinite(b).sum())} of {len(b)}): nothing to compare; see each "
                        "row's reason in results.jsonl (e.g. a reward that gave no answer) and evaluate again")
    out = [paired(a, b) | {"on": on} | ({"reward": reward} if reward else {})]
    if by:
        groups = np.array([group_of(row, by) for row in a_rows])
        out += [{by: g} | paired(a[groups == g], b[groups == g]) for g in sorted(set(groups))]
    return out


def run(args: argparse.Namespace) -> None:
    for line in compare(read_results(args.a), read_results(args.b), args.on, args.by, args.reward):
        print(strict_json.dumps(line))
