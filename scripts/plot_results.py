"""Held-out accuracy against training CPU minutes for every method of docs/results.md's test-split table, one PNG.

    python scripts/plot_results.py [--results docs/results.md] [--out docs/results_test_methods.png]

Reads the table under "## On the test split" (each row written from a ``scripts/measure.py`` summary):
the base → tuned accuracy, its min-max over seeds and the training minutes per seed. Methods are on
different levels (bases 8-81 %), so the y axis is the change against each row's own base, in points;
bars span the seeds' min-max. Rows whose training column gives no minutes are skipped (and named).
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

ACCURACY = re.compile(r"(?P<base>[\d.]+) → (?P<mean>[\d.]+) %(?: \((?P<lo>[\d.]+)-(?P<hi>[\d.]+)\))?")
MINUTES = re.compile(r"(?P<a>[\d.]+)(?:-(?P<b>[\d.]+))?(?: CPU)? min")


def test_split_rows(markdown: str) -> list[dict]:
    """The rows of the first table after '## On the test split': method, level, accuracies, minutes."""
    section = markdown.split("## On the test split", 1)[1]
    rows, started = [], False
    for line in section.splitlines():
        if not line.startswith("|"):
            if started:
                break
            continue
        started = True
        cells = [c.strip() for c in line.strip("|").split("|")]
        accuracy = ACCURACY.search(cells[3]) if len(cells) > 5 else None
        if accuracy is None:  # the header and its rule
            continue
        minutes = MINUTES.search(cells[5])
        mean = float(accuracy["mean"])
        rows.append({"method": cells[0], "level": cells[2], "base": float(accuracy["base"]), "mean": mean,
                     "lo": float(accuracy["lo"] or mean), "hi": float(accuracy["hi"] or mean), "seeds": cells[4],
                     "minutes": None if minutes is None else
                     (float(minutes["a"]) + float(minutes["b"] or minutes["a"])) / 2})
    return rows


def short_name(method: str) -> str:
    """A row's method cell cut to the method's name (before its first comma or parenthesis), marked when the
    row is a former form kept beside the current one."""
    name = re.split(r",| \(", method.replace("`", ""), maxsplit=1)[0].strip()
    former = any(word in method for word in ("earlier", "former", "measured before", "before the authors"))
    return f"{name} (former form)" if former else name


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(12, 8))
    ax.axhline(0.0, color="grey", lw=1)
    markers = {"easy": "o", "medium": "s", "motion": "^"}
    for row in rows:
        level = next((k for k in ("motion", "medium", "easy") if k in row["level"]), "easy")
        x, y = row["minutes"], row["mean"] - row["base"]
        ax.errorbar(x, y, yerr=[[row["mean"] - row["lo"]], [row["hi"] - row["mean"]]], fmt=markers[level],
                    capsize=3, label=f"{short_name(row['method'])} ({row['level']})")
    ax.set_xlabel("training minutes per seed (one thread)")
    ax.set_ylabel("test accuracy − base (points; bars: min-max over seeds)")
    ax.set_title("Held-out (test split) accuracy change against training compute, every method")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", default="docs/results.md")
    parser.add_argument("--out", default="docs/results_test_methods.png")
    args = parser.parse_args()
    rows = test_split_rows(Path(args.results).read_text())
    skipped = [r["method"] for r in rows if r["minutes"] is None]
    plotted = [r for r in rows if r["minutes"] is not None]
    plot(plotted, Path(args.out))
    print(f"plot_results: {len(plotted)} rows → {args.out}" + (f"; no minutes, skipped: {', '.join(skipped)}" if skipped else ""))


if __name__ == "__main__":
    main()
