"""One headline row: train a config with several seeds, score base and every tuned model once on the test split.

    python scripts/measure.py configs/tiny/flow_grpo_vvr.yaml --seeds 0 1 2 --minutes 15 --out runs/measure/flow_grpo
    python scripts/measure.py CONFIG ... --base runs/measure/base-medium   # reuse a base evaluation

Each seed trains with ``run.seed`` and ``data.seed`` set to it (its training evaluations read the validation
split, as every config does), then its final checkpoint (EMA weights when the config keeps an EMA) is
evaluated on the config's ``eval.bench`` / ``eval.level`` test split with noise seed 0, as is the base model:
every tuned sample is paired with the base sample of the same prompt and noise. Writes ``OUT/summary.json``,
``OUT/reward_curves.png`` (training reward per step, each seed) and prints a markdown row:
base → tuned mean (min-max over seeds), paired wins / losses pooled over seeds with a two-sided sign test.
Commands run as subprocesses with ``OMP_NUM_THREADS=--threads``; everything already finished is reused.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from flowalign.checkpoint import checkpoint_step, latest_checkpoint
from flowalign.cli.compare import compare, read_results, sign_test_p
from flowalign.config import load_config
from flowalign.io import write_json


def run(cmd: list[str], threads: int, log: Path) -> None:
    """``python -m flowalign CMD`` with its output in ``log``; a failure stops the measurement."""
    print("measure: flowalign " + " ".join(cmd), flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "OMP_WAIT_POLICY": "PASSIVE"}
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        if subprocess.call([sys.executable, "-m", "flowalign", *cmd], env=env, stdout=f, stderr=subprocess.STDOUT):
            raise SystemExit(f"measure: failed, see {log}")


def evaluate_command(cfg, out: Path, checkpoint: Path | None, n: int | None = None) -> list[str]:
    """``flowalign evaluate`` on ``cfg``'s test split for the base model (``checkpoint`` None) or a
    checkpoint's EMA weights (what training evaluates), noise seed 0, so every sample pairs with the base's."""
    from flowalign.train import resolve_model_path

    cmd = ["evaluate", "--model", str(resolve_model_path(cfg.model.path)), "--bench", cfg.eval.bench, "--level", str(cfg.eval.level),
           "--split", "test", "--batch-size", str(cfg.eval.batch_size), "--out", str(out), "--overwrite"]
    if n is not None:
        cmd += ["--n", str(n)]
    if cfg.eval.num_steps:
        cmd += ["--steps", str(cfg.eval.num_steps)]
    if checkpoint is not None:
        cmd += ["--adapter", str(checkpoint)] + (["--ema"] if float(cfg.trainer.get("ema_decay", 0.0)) > 0 else [])
    return cmd


def test_eval(cfg, out: Path, threads: int, checkpoint: Path | None) -> Path:
    """The test-split evaluation of the base model or of ``checkpoint`` (reused when finished)."""
    if not (out / "metrics.json").is_file():
        run(evaluate_command(cfg, out, checkpoint), threads, out.parent / f"{out.name}.log")
    return out


def train_seed(config: str, overrides: list[str], seed: int, minutes: float | None, run_dir: Path,
               threads: int) -> Path:
    """Train one seed to its budget → its final checkpoint."""
    marker = run_dir / "final_metrics.json"
    if not marker.is_file():
        extra = [f"run.seed={seed}", f"data.seed={seed}", f"run.output_dir={run_dir}", "run.progress=false",
                 "run.resume=auto"] + ([f"trainer.max_minutes={minutes}"] if minutes else [])
        run(["train", config, *overrides, *extra], threads, run_dir.parent / f"{run_dir.name}.log")
    checkpoint = latest_checkpoint(run_dir)
    if checkpoint is None:
        raise SystemExit(f"measure: {run_dir} wrote no checkpoint")
    return checkpoint


def reward_curve(run_dir: Path) -> list[tuple[int, float]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [(r["step"], r["reward/total"]) for r in rows if "reward/total" in r]


def plot(curves: dict[int, list[tuple[int, float]]], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for seed, points in curves.items():
        xs, ys = [s for s, _ in points], [r for _, r in points]
        smooth = [statistics.mean(ys[max(0, i - 4): i + 1]) for i in range(len(ys))]
        ax.plot(xs, ys, alpha=0.2)
        ax.plot(xs, smooth, label=f"seed {seed}", color=ax.lines[-1].get_color())
    ax.set_xlabel("training step")
    ax.set_ylabel("training reward (batch mean; 5-step mean bold)")
    ax.set_title(title)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def summarise(base: Path, tuned: dict[int, Path], curves: dict[int, list[tuple[int, float]]],
              steps: dict[int, int] | None = None) -> dict[str, Any]:
    """The headline row's numbers. ``steps``: each seed's trained steps (its final checkpoint's step); without
    it, the last step that logged a training reward (a trainer training on replayed groups alone logs none)."""
    base_rows = read_results(base)
    per_seed, wins, losses = {}, 0, 0
    for seed, folder in tuned.items():
        pair = compare(base_rows, read_results(folder), on="passed")[0]
        accuracy = json.loads((folder / "metrics.json").read_text())["accuracy"]
        first, last = curves[seed][:5], curves[seed][-5:]
        per_seed[seed] = {"accuracy": accuracy, "wins": pair["wins"], "losses": pair["losses"], "eval": str(folder),
                          "steps": (steps or {}).get(seed, curves[seed][-1][0] if curves[seed] else 0),
                          "reward_first5": statistics.mean(r for _, r in first) if first else None,
                          "reward_last5": statistics.mean(r for _, r in last) if last else None}
        wins, losses = wins + pair["wins"], losses + pair["losses"]
    accs = [s["accuracy"] for s in per_seed.values()]
    return {"base": json.loads((base / "metrics.json").read_text())["accuracy"], "n": len(base_rows),
            "mean": statistics.mean(accs), "min": min(accs), "max": max(accs),
            "stdev": statistics.stdev(accs) if len(accs) > 1 else 0.0,
            "wins": wins, "losses": losses, "sign_test_p": sign_test_p(wins, losses), "seeds": per_seed}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; overrides may also follow a one-value flag (``--base B key=value``), not ``--seeds``,
    which takes every number after it."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*", help="config overrides (key=value) for every seed")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--minutes", type=float, default=None, help="trainer.max_minutes for each seed")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--base", default=None, help="an existing test evaluation of the base model to pair with")
    parser.add_argument("--out", required=True)
    return parser.parse_intermixed_args(argv)


def main() -> None:
    args = parse()
    out = Path(args.out)
    cfg = load_config(args.config, args.overrides)
    base = Path(args.base) if args.base else test_eval(cfg, out / "base", args.threads, None)
    tuned, curves, steps = {}, {}, {}
    for seed in args.seeds:
        run_dir = out / f"seed-{seed}"
        checkpoint = train_seed(args.config, args.overrides, seed, args.minutes, run_dir, args.threads)
        tuned[seed] = test_eval(cfg, out / f"test-seed-{seed}", args.threads, checkpoint)
        curves[seed], steps[seed] = reward_curve(run_dir), checkpoint_step(checkpoint)
    summary = summarise(base, tuned, curves, steps) | {"config": args.config, "overrides": args.overrides,
                                                 "minutes": args.minutes, "threads": args.threads}
    write_json(out / "summary.json", summary)
    plot(curves, f"{cfg.trainer['name']}: {Path(args.config).name}", out / "reward_curves.png")
    print(f"| {cfg.trainer['name']} | `{args.config}` | {cfg.eval.level} | {100 * summary['base']:.1f} → "
          f"{100 * summary['mean']:.1f} % ({100 * summary['min']:.1f}-{100 * summary['max']:.1f}) | {len(args.seeds)} | "
          f"{args.minutes or '-'} | {summary['wins']} / {summary['losses']} (p = {summary['sign_test_p']:.2g}) |")


if __name__ == "__main__":
    main()
