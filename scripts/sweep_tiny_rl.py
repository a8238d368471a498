"""Sweep RL settings on the embedded tiny model: each variant trains for a fixed CPU-time budget from the
same starting weights and is evaluated on the same held-out split. Writes a markdown table and a plot.

    python scripts/sweep_tiny_rl.py --minutes 6 --out runs/sweep [--only NAME ...]

The variants are the record of what was tried for the main job (docs/tiny_rl.md).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


from flowalign.config import load_config  # noqa: E402
from flowalign.train import train  # noqa: E402

BASE = "configs/tiny/flow_grpo_vvr.yaml"
VARIANTS: dict[str, list[str]] = {
    "lora_r16_lr3e-4": ["model.finetune=lora", "trainer.lr=3e-4"],
    "lora_r16_lr1e-3": ["model.finetune=lora", "trainer.lr=1e-3"],
    "full_lr1e-4": ["model.finetune=full", "trainer.lr=1e-4"],
    "full_lr3e-5": ["model.finetune=full", "trainer.lr=3e-5"],
    "full_lr1e-4_epochs2_clip0.2": ["model.finetune=full", "trainer.lr=1e-4", "trainer.inner_epochs=2",
                                    "trainer.clip_range=0.2"],
    "full_lr1e-4_steps3": ["model.finetune=full", "trainer.lr=1e-4", "trainer.steps_per_chunk=3"],
    "flash_full_lr1e-4": ["model.finetune=full", "trainer.name=flash_grpo", "trainer.lr=1e-4"],
    "full_lr2e-5_1update": ["model.finetune=full", "trainer.lr=2e-5", "trainer.updates_per_epoch=1"],
    # the shipped main job since 00:10 on 2026-11-30: a short run with the LR annealed to 10 %
    "full_lr5e-5_cosine_80steps": ["trainer.lr=5e-5", "trainer.lr_schedule=cosine", "trainer.lr_warmup_steps=5",
                                   "trainer.max_steps=80"],
    "flash_lr5e-5_cosine_80steps": ["trainer.name=flash_grpo", "trainer.steps_per_chunk=0", "trainer.lr=5e-5",
                                    "trainer.lr_schedule=cosine", "trainer.lr_warmup_steps=5", "trainer.max_steps=80"],
    # session 4, on the 8-block base with the named-object partial credit (the shipped config, gentler rate)
    "full_lr2e-5_cosine_80steps": ["trainer.lr=2e-5", "trainer.lr_schedule=cosine", "trainer.lr_warmup_steps=5",
                                   "trainer.max_steps=80"],
    # session 5 (the shipped config: lr 5e-5, cosine, 80 steps), evaluated with --eval-n 500
    "s5_window3": ["trainer.sde_window=3", "trainer.max_steps=80"],
    "s5_window3_lr1e-4": ["trainer.sde_window=3", "trainer.lr=1e-4", "trainer.max_steps=80"],
    "s5_shared_noise": ["trainer.shared_initial_noise=true", "trainer.max_steps=80"],
    "s5_flash_shared_noise": ["trainer.name=flash_grpo", "trainer.steps_per_chunk=0", "trainer.shared_initial_noise=true",
                              "trainer.max_steps=80"],
    "s5_p16_lr1e-4_30steps": ["trainer.prompts_per_step=16", "trainer.lr=1e-4", "trainer.lr_warmup_steps=2",
                              "trainer.max_steps=30"],
    # four fixed training tasks: does the training reward rise at all?
    "s5_overfit4_lr5e-5": ["data.n=4", "trainer.max_steps=40"],
    "s5_overfit4_lr2e-4": ["data.n=4", "trainer.lr=2e-4", "trainer.max_steps=40"],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=BASE)
    parser.add_argument("--minutes", type=float, default=6.0)
    parser.add_argument("--out", default="runs/sweep")
    parser.add_argument("--only", nargs="*", default=None)
    parser.add_argument("--eval-n", type=int, default=96)
    parser.add_argument("--plot", default=None, help="only plot the recorded results' curves to this PNG")
    parser.add_argument("--record", nargs=2, metavar=("RUN_DIR", "NAME"), help="only record a finished run")
    args = parser.parse_args()
    out = Path(args.out)
    if args.record:
        record_run(Path(args.record[0]), args.record[1], [], out / "results.jsonl")
        return
    if args.plot:
        plot_results(out / "results.jsonl", Path(args.plot))
        return
    results_path = out / "results.jsonl"
    done = {json.loads(line)["name"] for line in results_path.read_text().splitlines()} if results_path.exists() else set()
    for name, overrides in VARIANTS.items():
        if (args.only and name not in args.only) or name in done:
            continue
        cfg = load_config(args.config, [
            f"run.output_dir={out / name}", f"run.name={name}", "run.checkpoint_every=100000", "eval.every=0",
            f"eval.n={args.eval_n}", "eval.gallery=false", "trainer.max_steps=100000",
            f"trainer.max_minutes={args.minutes}", *overrides,
        ])
        train(cfg)
        record_run(out / name, name, overrides, results_path)


def record_run(run_dir: Path, name: str, overrides: list[str], results_path: Path) -> dict:
    """Append a finished run's before/after held-out accuracy and its reward curve to ``results_path``."""
    evals = sorted((run_dir / "evals").glob("step-*"))
    before, after = (json.loads((d / "metrics.json").read_text()) for d in (evals[0], evals[-1]))
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/total" in r]
    result = {"name": name, "overrides": overrides, "steps": len(steps),
              "minutes": steps[-1]["time/train_minutes"] if steps else 0.0,
              "acc_before": before["accuracy"], "acc_after": after["accuracy"],
              "evals": [(int(d.name.split("-")[1]), json.loads((d / "metrics.json").read_text())["accuracy"]) for d in evals],
              "curve": [(r["time/train_minutes"], r["reward/total"]) for r in steps]}
    results_path.parent.mkdir(parents=True, exist_ok=True)
    with open(results_path, "a") as f:
        f.write(json.dumps(result) + "\n")
    print(f"{name}: held-out accuracy {result['acc_before']:.3f} -> {result['acc_after']:.3f} in {len(steps)} steps")
    return result


def plot_results(results_path: Path, png: Path) -> None:
    """Training reward against training minutes, one line per variant (5-step moving average)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for line in results_path.read_text().splitlines():
        r = json.loads(line)
        xs, ys = zip(*r["curve"]) if r["curve"] else ((), ())
        smooth = [sum(ys[max(0, i - 4) : i + 1]) / len(ys[max(0, i - 4) : i + 1]) for i in range(len(ys))]
        ax.plot(xs, smooth, label=f"{r['name']} (held-out acc {r['acc_before']:.2f}->{r['acc_after']:.2f})")
    ax.set_xlabel("training minutes (CPU)")
    ax.set_ylabel("training reward (vvr, 5-step mean)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    print(f"wrote {png}")


if __name__ == "__main__":
    main()
