"""Every method's held-out accuracy against the same base, in one table and one plot.

    python scripts/compare_methods.py --base runs/s9/v5-medium --png docs/phase5_methods.png \
        "Flow-GRPO=runs/s10/flow_grpo_p5/evals/step-000047" "SOAR=runs/s10/soar_p5/evals/step-000100" ...

Each ``NAME=EVAL_DIR`` is a run's evaluation (``<run>/evals/step-N``, written by the training loop with
the same split and noise as ``flowalign evaluate --out`` wrote ``--base``). The training minutes come from
the run's ``metrics.jsonl`` (``time/train_minutes`` at step N); ``NAME=EVAL_DIR@MINUTES`` gives them for a
checkpoint evaluated apart (``flowalign evaluate --adapter <run>/checkpoints/step-N --out EVAL_DIR``).
A NAME given several times is one run (or seed) at several budgets: its points are joined into a curve.
Prints a markdown table — accuracy, task-by-task wins and losses against the base and a two-sided sign
test — and plots accuracy against training minutes with the base's ±1 standard-error band, so a reader
sees at once which points are outside the noise.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flowalign.cli.compare import read_results as read, sign_test_p  # noqa: E402


def train_minutes(eval_dir: Path) -> float:
    """``time/train_minutes`` of the run that wrote ``<run>/evals/step-N``, at its last record up to step N."""
    run, step = eval_dir.parent.parent, int(eval_dir.name.split("-")[-1])
    minutes = float("nan")
    for line in (run / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec.get("step", 0) <= step and "time/train_minutes" in rec:
            minutes = rec["time/train_minutes"]
    return minutes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", type=Path, required=True, help="the base model's evaluation folder")
    ap.add_argument("--png", type=Path, default=None)
    ap.add_argument("--title", default="held-out accuracy against the base")
    ap.add_argument("runs", nargs="+", help="NAME=EVAL_DIR")
    args = ap.parse_args()

    base = read(args.base)
    a = np.array([r["all_passed"] for r in base])
    rows = []
    for item in args.runs:
        name, _, target = item.partition("=")
        if not target:
            raise SystemExit(f"{item!r}: give NAME=EVAL_DIR or NAME=EVAL_DIR@MINUTES")
        folder, at, given = target.partition("@")
        trained = read(Path(folder))
        if [r["prompt"] for r in trained] != [r["prompt"] for r in base]:
            raise SystemExit(f"{folder}: not the base's split; evaluate both on the same tasks")
        b = np.array([r["all_passed"] for r in trained])
        wins, losses = int((b & ~a).sum()), int((a & ~b).sum())
        minutes = float(given) if at else train_minutes(Path(folder))
        rows.append((name, minutes, b.mean(), wins, losses, sign_test_p(wins, losses)))

    print(f"| method | training minutes | held-out accuracy ({len(a)}) | vs base W / L | sign test p |")
    print("|---|---|---|---|---|")
    print(f"| base | 0 | {100 * a.mean():.1f} % | — | — |")
    for name, minutes, acc, wins, losses, p in rows:
        print(f"| {name} | {minutes:.1f} | {100 * acc:.1f} % | {wins} / {losses} | {p:.2f} |")

    if args.png:
        fig = plot(rows, a, args.title)
        args.png.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(args.png, dpi=120)
        print(f"wrote {args.png}")


def plot(rows: list[tuple], base_passed: np.ndarray, title: str):
    """Accuracy against training minutes: one line per NAME (its budgets joined), one colour each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    a = base_passed
    se = np.sqrt(a.mean() * (1 - a.mean()) / len(a))
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    right = max(m for _, m, *_ in rows if np.isfinite(m)) * 1.15
    ax.axhspan(100 * (a.mean() - se), 100 * (a.mean() + se), color="0.85", label="base ± one evaluation's s.e.")
    ax.axhline(100 * a.mean(), color="0.4", ls="--", lw=1)
    names = list(dict.fromkeys(r[0] for r in rows))  # first-seen order
    palette = plt.get_cmap("tab10" if len(names) <= 10 else "tab20").colors  # distinct up to 20 methods
    for i, name in enumerate(names):
        colour = palette[i % len(palette)]  # past 20 colours repeat; no method is left out
        points = sorted((m, 100 * acc, w, l) for n, m, acc, w, l, _ in rows if n == name)
        xs, ys = [p[0] for p in points], [p[1] for p in points]
        ax.plot(xs, ys, marker="o", ms=6, lw=1.2, zorder=3, color=colour, gid=name)
        m, acc, w, l = points[-1]  # label the run's last budget
        ax.annotate(f"{name} ({w}/{l})", (m, acc), textcoords="offset points", xytext=(5, 4), fontsize=8, color=colour)
    ax.set_xlim(0, right)
    ax.set_xlabel("training minutes (one CPU thread)")
    ax.set_ylabel("held-out accuracy (%)")
    ax.set_title(title, fontsize=10)
    ax.legend(loc="lower left", fontsize=8)
    fig.tight_layout()
    return fig

if __name__ == "__main__":
    main()
