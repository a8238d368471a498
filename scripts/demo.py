"""``make demo``: fine-tune the embedded tiny model on VVR, then score base and tuned on the test split.

    python scripts/demo.py [--config configs/tiny/demo.yaml] [key=value ...]

Trains DiffusionOPSD for a fixed number of steps (``trainer.max_steps``; evaluations during training use
the validation split), then evaluates the base model and the tuned one (EMA weights, as training
evaluates them) once on the test split, whose prompts are compositions training never saw, with the same
noise per prompt. Run again, it reuses the finished run and evaluations. The last line reads
``demo: test accuracy A -> B (+X points, W wins / L losses, n=N)``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

# as the flowalign command does: OpenMP workers that spin while a sibling is descheduled make steps many
# times slower on busy cores; must precede torch
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from flowalign.config import TrainConfig, load_config  # noqa: E402
from flowalign.errors import UserError  # noqa: E402
from measure import evaluate_command  # noqa: E402

#: seconds per rollout of a training step, per evaluated sample, and per sample of the two concurrent
#: test evaluations, on 2 cores (for the time estimate only)
ROLLOUT_SECONDS, SAMPLE_SECONDS, PAIRED_SAMPLE_SECONDS = 0.31, 0.36, 0.27


def plan(cfg: TrainConfig, n_test: int) -> str:
    """What the demo will do and roughly how long it takes."""
    steps = int(cfg.trainer["max_steps"])
    rollouts = int(cfg.trainer.get("prompts_per_step", 1)) * int(cfg.trainer.get("group_size", 1))
    evals = (steps // cfg.eval.every if cfg.eval.every else 1) * (cfg.eval.n or 500)
    minutes = (steps * rollouts * ROLLOUT_SECONDS + evals * SAMPLE_SECONDS + 2 * n_test * PAIRED_SAMPLE_SECONDS) / 60
    return (f"demo: fine-tune {cfg.model.path} with {cfg.trainer['name']} on {cfg.eval.bench} "
            f"{'/'.join([cfg.data.level] if isinstance(cfg.data.level, str) else cfg.data.level)} tasks for {steps} steps "
            f"(validation checks on {cfg.eval.n} tasks), then score the base and the tuned model on the {n_test} "
            f"test tasks: about {minutes:.0f} minutes on 2 cores. Output: {cfg.run.output_dir}")


def finished(run_dir: Path, steps: int) -> Path | None:
    """The final checkpoint of a finished run, else None."""
    from flowalign.checkpoint import step_dir_name

    final = run_dir / "checkpoints" / step_dir_name(steps)
    return final if (run_dir / "evals" / step_dir_name(steps) / "metrics.json").is_file() and final.is_dir() else None


def evaluate_base_and_tuned(cfg: TrainConfig, out: Path, n: int, checkpoint: Path) -> tuple[Path, Path]:
    """Both test evaluations at once, one process and one thread each: about 30% faster on 2 cores than one
    after the other on two threads (the tiny model's kernels are too small to split well). The tuned
    model's progress bar is shown; the base model's log goes to ``out/base.log``."""
    jobs = {name: (out / name, ckpt) for name, ckpt in (("base", None), (checkpoint.name, checkpoint))}
    todo = {name: job for name, job in jobs.items() if not (job[0] / "metrics.json").is_file()}
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = {}
    for name, (folder, ckpt) in todo.items():
        cmd = evaluate_command(cfg, folder, ckpt, n)
        print("demo: flowalign " + " ".join(cmd), flush=True)
        log = open(out / f"{name}.log", "w") if ckpt is None else None
        argv = [sys.executable, "-m", "flowalign", *cmd]
        procs[name] = (subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=log), log)
    for name, (proc, log) in procs.items():
        if proc.wait() != 0:
            raise UserError(f"the test evaluation {jobs[name][0]} failed (exit {proc.returncode})"
                            + (f"; its log: {out / (name + '.log')}" if log else ""))
        if log:
            log.close()
    return jobs["base"][0], jobs[checkpoint.name][0]


def summary(base: Path, tuned: Path) -> str:
    """The demo's last line: test accuracy before and after, and paired wins / losses."""
    from flowalign.cli.compare import compare, read_results

    a, b = (json.loads((d / "metrics.json").read_text())["accuracy"] for d in (base, tuned))
    pair = compare(read_results(base), read_results(tuned), on="passed")[0]
    return (f"demo: test accuracy {a:.3f} -> {b:.3f} ({100 * (b - a):+.1f} points, {pair['wins']} wins / "
            f"{pair['losses']} losses, n={pair['n']})")


def quiet_loading() -> None:
    """No per-component loading bars: the demo's own progress is what a reader follows."""
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    diffusers_logging.disable_progress_bar()
    transformers_logging.disable_progress_bar()


def run_demo(config: str, overrides: list[str], n_test: int) -> str:
    quiet_loading()
    cfg = load_config(config, overrides)
    run_dir, steps = Path(cfg.run.output_dir), int(cfg.trainer["max_steps"])
    print(plan(cfg, n_test), flush=True)
    t0 = time.time()
    checkpoint = finished(run_dir, steps)
    if checkpoint is None:
        from flowalign.train import train

        train(cfg)
        checkpoint = finished(run_dir, steps)
        if checkpoint is None:
            raise UserError(f"{run_dir} did not reach step {steps}; run the demo again to continue it")
    else:
        print(f"demo: reusing the finished run in {run_dir}")
    base, tuned = evaluate_base_and_tuned(cfg, run_dir / "test", n_test, checkpoint)
    gallery = write_test_gallery(run_dir, base, tuned)
    print(f"demo: {(time.time() - t0) / 60:.1f} minutes; gallery (base vs tuned on test): {gallery.resolve()}")
    return summary(base, tuned)


def write_test_gallery(run_dir: Path, base: Path, tuned: Path) -> Path:
    from flowalign.gallery import gallery_from_evals, write_gallery

    columns, rows = gallery_from_evals([base, tuned], ["base", f"tuned ({tuned.name})"])
    return write_gallery(run_dir / "test" / "gallery", columns, rows, title="demo: base vs tuned on the test split")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/tiny/demo.yaml")
    parser.add_argument("--n-test", type=int, default=500, help="test tasks to score (default: the whole split)")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    try:
        line = run_demo(args.config, args.overrides, args.n_test)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
