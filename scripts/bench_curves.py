"""Reward against wall-clock time for Flow-GRPO and Flash-GRPO with the shipped tiny configs, in one run, as a PNG.

    python scripts/bench_curves.py [--minutes 10] [--out runs/bench-curves]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch


def _main_job(args: argparse.Namespace, trainer: str, run_dir: Path, *extra: str):
    from flowalign.config import load_config
    from flowalign.train import build_trainer

    overrides = [f"run.output_dir={run_dir}", "run.resume=never", "run.progress=false", "run.checkpoint_every=100000",
                 f"trainer.name={trainer}", "eval.bench=null", *extra]
    if run_dir.exists():
        import shutil

        shutil.rmtree(run_dir)
    return build_trainer(load_config(args.config, overrides))


def bench_curves(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    curves = {}
    for name in ("flow_grpo", "flash_grpo"):
        t = _main_job(args, name, out / name)
        t0, points = time.perf_counter(), []
        while time.perf_counter() - t0 < args.minutes * 60:
            logs = t.train_step()
            t.step += 1
            points.append((time.perf_counter() - t0, logs["reward/total"]))
        curves[name] = points
        print(f"{name}: {len(points)} steps in {args.minutes} min, last-5 mean reward "
              f"{statistics.mean(r for _, r in points[-5:]):.3f}")
    _plot(curves, out / "reward_vs_time.png")


def _plot(curves: dict[str, list[tuple[float, float]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, points in curves.items():
        xs = [t / 60 for t, _ in points]
        ys = [r for _, r in points]
        smooth = [statistics.mean(ys[max(0, i - 4) : i + 1]) for i in range(len(ys))]
        ax.plot(xs, ys, alpha=0.25)
        ax.plot(xs, smooth, label=name, color=ax.lines[-1].get_color())
    ax.set_xlabel("wall-clock minutes (2 CPU cores)")
    ax.set_ylabel("training reward (vvr)")
    ax.legend()
    ax.grid(alpha=0.3)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/tiny/flow_grpo_vvr.yaml")
    parser.add_argument("--minutes", type=float, default=10.0, help="wall-clock per trainer")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="runs/bench-curves")
    bench_curves(parser.parse_args())


if __name__ == "__main__":
    main()
