"""``make demo``: fine-tune the embedded tiny model on VVR, then score base and tuned on the test split.

    python scripts/demo.py [--config configs/tiny/demo.yaml] [key=value ...]

Trains DiffusionOPSD for a fixed number of steps (``trainer.max_steps``; evaluations during training use
the validation split) and scores the base model and the tuned one (EMA weights, as training evaluates
them) once on the test split, whose prompts are compositions training never saw, with the same noise per
prompt. The base model is scored while training runs, by one thread at the lowest priority that only
takes the cycles training leaves idle. Run again, it reuses the finished run and evaluations. The last line reads
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
from flowalign.train import claim_run_dir  # noqa: E402
from measure import evaluate_command  # noqa: E402

#: seconds per rollout of a training step and per evaluated sample on 2 cores (for the time estimate only;
#: the base model's test evaluation runs in training's idle cycles and is not counted)
ROLLOUT_SECONDS, SAMPLE_SECONDS = 0.31, 0.36


def plan(cfg: TrainConfig, n_test: int) -> str:
    """What the demo will do and roughly how long it takes."""
    steps = int(cfg.trainer["max_steps"])
    rollouts = int(cfg.trainer.get("prompts_per_step", 1)) * int(cfg.trainer.get("group_size", 1))
    evals = (steps // cfg.eval.every if cfg.eval.every else 1) * (cfg.eval.n or 500)
    minutes = (steps * rollouts * ROLLOUT_SECONDS + (evals + n_test) * SAMPLE_SECONDS) / 60
    return (f"demo: fine-tune {cfg.model.path} with {cfg.trainer['name']} on {cfg.eval.bench} "
            f"{'/'.join([cfg.data.level] if isinstance(cfg.data.level, str) else cfg.data.level)} tasks for {steps} steps "
            f"(validation checks on {cfg.eval.n} tasks), then score the base and the tuned model on the {n_test} "
            f"test tasks: about {minutes:.0f} minutes on 2 cores. Output: {cfg.run.output_dir}")


def finished(run_dir: Path, steps: int) -> Path | None:
    """The final checkpoint of a finished run, else None."""
    from flowalign.checkpoint import step_dir_name

    final = run_dir / "checkpoints" / step_dir_name(steps)
    return final if (run_dir / "evals" / step_dir_name(steps) / "metrics.json").is_file() and final.is_dir() else None


def start_test_evaluation(cfg: TrainConfig, folder: Path, checkpoint: Path | None, n: int,
                          background: bool, niceness: int = 19) -> subprocess.Popen | None:
    """``flowalign evaluate`` of the base model (``checkpoint`` None) or a checkpoint on the test split, as a
    subprocess; None when ``folder`` already holds its metrics.

    ``background``: one thread at the lowest CPU priority (``niceness``) with its log in ``folder.log``, so that
    it only takes the cycles the foreground leaves idle (training on two threads leaves about a quarter of two
    cores idle, enough for the base model's 500 samples). Otherwise two threads with the progress bar shown.
    """
    if (folder / "metrics.json").is_file():
        return None
    folder.parent.mkdir(parents=True, exist_ok=True)
    cmd = evaluate_command(cfg, folder, checkpoint, n)
    print("demo: flowalign " + " ".join(cmd) + ("  (in the background)" if background else ""), flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1" if background else str(min(2, os.cpu_count() or 1))}
    argv = [sys.executable, "-m", "flowalign", *cmd]
    if not background:
        return subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL)
    with open(folder.parent / f"{folder.name}.log", "w") as log:
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=log)
    try:  # right after the start: the child's OpenMP workers, created at its first kernel seconds later, inherit it
        os.setpriority(os.PRIO_PROCESS, proc.pid, niceness)
    except (AttributeError, OSError):
        pass
    return proc


def wait_for(proc: subprocess.Popen | None, folder: Path) -> Path:
    """``folder`` once its evaluation has finished; a failed one raises with the place of its log."""
    if proc is not None and proc.wait() != 0:
        log = folder.parent / f"{folder.name}.log"
        raise UserError(f"the test evaluation {folder} failed (exit {proc.returncode})"
                        + (f"; its log: {log}" if log.is_file() else ""))
    return folder


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


def run_demo(config: str, overrides: list[str], n_test: int, background_niceness: int = 19) -> str:
    quiet_loading()
    cfg = load_config(config, overrides)
    run_dir, steps = Path(cfg.run.output_dir), int(cfg.trainer["max_steps"])
    print(plan(cfg, n_test), flush=True)
    t0 = time.time()
    test_dir = run_dir / "test"
    claim_run_dir(run_dir, overwrite=False)  # the run's folder before the base evaluation writes into it
    base_proc = start_test_evaluation(cfg, test_dir / "base", None, n_test, background=True,
                                      niceness=background_niceness)
    try:
        checkpoint = finished(run_dir, steps)
        if checkpoint is None:
            from flowalign.train import train

            train(cfg)
            checkpoint = finished(run_dir, steps)
            if checkpoint is None:
                raise UserError(f"{run_dir} did not reach step {steps}; run the demo again to continue it")
        else:
            print(f"demo: reusing the finished run in {run_dir}")
        tuned_proc = start_test_evaluation(cfg, test_dir / checkpoint.name, checkpoint, n_test, background=False)
        tuned = wait_for(tuned_proc, test_dir / checkpoint.name)
        base = wait_for(base_proc, test_dir / "base")
    finally:
        if base_proc is not None and base_proc.poll() is None:  # interrupted: leave nothing running
            base_proc.terminate()
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
