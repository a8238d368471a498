"""Paired win rate of one evaluation against another (same prompts, same noise seeds).

    python scripts/win_rate.py BASE_EVAL_DIR TRAINED_EVAL_DIR [--partial-credit --level medium]

Each folder is what ``flowalign evaluate --out`` (or a run's ``evals/step-XXXXXX``) writes. Sample i of both
got the same noise, so prompt by prompt the trained sample wins, ties or loses on the verifier's score.
Prints wins / ties / losses, the win rate ``(wins + ties/2) / n``, ``wins / (wins + losses)`` and a two-sided
sign test on the decided prompts.
``--by constraint`` or ``--by shape`` adds one line per group of prompts (the constraint types of the task, or
the shapes its prompt names), each with the two accuracies: where a change gained and where it lost.
``--partial-credit`` re-scores the saved samples with VVR's per-object partial credit (a finer score than
the all-or-nothing verdict; needs the split: ``--bench``, ``--level`` and ``--n``/``--seed`` as evaluated).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np


def read(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "results.jsonl").read_text().splitlines() if line.strip()]


def partial_credit(folder: Path, rows: list[dict], bench: str, level: str, n: int | None, seed: int | None) -> list[float]:
    import torch
    from PIL import Image

    import rewards
    from flowalign.benchmarks import load_benchmark

    split = load_benchmark(bench, level, n, seed)
    if [r["prompt"] for r in rows] != split.prompts[: len(rows)]:
        raise SystemExit(f"{folder}: prompts do not match the {bench}/{level} split; pass the --n/--seed it was evaluated with")
    images = torch.stack([torch.from_numpy(np.asarray(Image.open(folder / r["file"]).convert("RGB"), dtype=np.float32) / 255)
                          .permute(2, 0, 1) for r in rows])
    out = rewards.load(bench, partial_credit=True)(images, split.prompts[: len(rows)], split.metadata[: len(rows)])
    return out.total.tolist()


def sign_test_p(wins: int, losses: int) -> float:
    """Two-sided exact sign test of wins against losses (ties left out); 1.0 when nothing was decided."""
    from scipy.stats import binomtest

    return float(binomtest(wins, wins + losses).pvalue) if wins + losses else 1.0


def group_of(row: dict, by: str) -> str:
    """The constraint types of a result row, or the shape names its prompt uses ("-" for none)."""
    if by == "constraint":
        return "+".join(sorted({name for name, _ in row["constraints"]}))
    from rewards.vvr.geometry import SHAPES

    words = row["prompt"].replace(",", " ").split()
    named = sorted({w.rstrip("s") if w.rstrip("s") in SHAPES else w for w in words} & set(SHAPES))
    return "+".join(named) or "-"


def compare(a: np.ndarray, b: np.ndarray) -> dict:
    """Paired wins / ties / losses of scores ``b`` against ``a`` (same prompts), their rates and sign test."""
    wins, losses = int((b > a).sum()), int((b < a).sum())
    ties = len(a) - wins - losses
    return {"n": len(a), "wins": wins, "ties": ties, "losses": losses,
            "win_rate": (wins + ties / 2) / len(a),
            "wins_over_decided": wins / (wins + losses) if wins + losses else float("nan"),
            "sign_test_p": sign_test_p(wins, losses),
            "base_mean": float(a.mean()), "trained_mean": float(b.mean())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("base", type=Path)
    p.add_argument("trained", type=Path)
    p.add_argument("--partial-credit", action="store_true")
    p.add_argument("--bench", default="vvr")
    p.add_argument("--level", default="medium")
    p.add_argument("--n", type=int, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--by", choices=("constraint", "shape"), default=None,
                   help="also compare per group of prompts: by the task's constraint types or the shapes named")
    args = p.parse_args()
    base, trained = read(args.base), read(args.trained)
    if [r["prompt"] for r in base] != [r["prompt"] for r in trained]:
        raise SystemExit("the two evaluations hold different prompts; evaluate both on the same split")
    scores = {}
    for name, folder, rows in (("base", args.base, base), ("trained", args.trained, trained)):
        scores[name] = (partial_credit(folder, rows, args.bench, args.level, args.n or len(rows), args.seed)
                        if args.partial_credit else [r["score"] for r in rows])
    a, b = np.array(scores["base"]), np.array(scores["trained"])
    score = "partial_credit" if args.partial_credit else "verifier"
    print(json.dumps(compare(a, b) | {"score": score}))
    if args.by:
        groups = np.array([group_of(row, args.by) for row in base])
        for group in sorted(set(groups)):
            mask = groups == group
            print(json.dumps({args.by: group} | compare(a[mask], b[mask])))


if __name__ == "__main__":
    main()
