"""Benchmarks (ratios measured in one run; never timed assertions in tests).

    python scripts/bench.py rollout [--model DIR] [--steps 20] [--repeats 7]
    python scripts/bench.py train [--steps 5] [--minutes 10] [--out runs/bench-train]

``rollout``: ``flowalign.sampling.rollout`` (ODE, decode included) against the diffusers pipeline's own
``__call__`` on the same folder, same steps and seed, alternating, median of the repeats; target ratio
≤ 1.10. Also reports the cost of an SDE rollout relative to the ODE one.

``train``: (1) the share of a Flow-GRPO step spent outside the model's forward/backward passes, the VAE
decode and the reward — the toolkit's overhead, target ≤ 10% — and peak memory; (2) reward against
wall-clock time for Flow-GRPO and Flash-GRPO on the main job (``--minutes`` each), saved as a PNG plot.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _median_time(fn, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def bench_rollout(args: argparse.Namespace) -> None:
    import diffusers

    import pipelines
    from flowalign.paths import default_model_dir
    from flowalign.sampling import rollout

    model = Path(args.model) if args.model else default_model_dir()
    if not (model / "model_index.json").exists():
        from pipelines.tiny import save_tiny

        model = Path(tempfile.mkdtemp()) / "tiny-sd3"
        save_tiny("sd3", model)
        print(f"(no embedded model found; benchmarking a random tiny SD3 at {model})")
    torch.set_num_threads(args.threads)
    policy = pipelines.load(model)
    pipe = diffusers.DiffusionPipeline.from_pretrained(model)
    pipe.set_progress_bar_config(disable=True)
    d = policy.defaults
    prompts = [args.prompt] * args.batch
    guidance = float(d.get("guidance_scale", 1.0))
    size = dict(height=d["height"], width=d["width"])

    def ours(sampler: str = "ode"):
        rollout(policy, prompts, num_steps=args.steps, sampler=sampler, guidance_scale=guidance,
                generator=torch.Generator().manual_seed(0))

    def theirs():
        kw = {"max_sequence_length": d["max_sequence_length"]} if "max_sequence_length" in d else {}
        pipe(prompts, num_inference_steps=args.steps, guidance_scale=guidance, output_type="pt",
             generator=torch.Generator().manual_seed(0), **size, **kw)

    ours(), theirs()  # warm-up (and fills the prompt cache, as in training)
    t_ours, t_theirs, t_sde = [], [], []
    for _ in range(args.repeats):
        t_ours += _median_time(ours, 1)
        t_theirs += _median_time(theirs, 1)
        t_sde += _median_time(lambda: ours("flow_grpo"), 1)
    m_ours, m_theirs, m_sde = (statistics.median(t) for t in (t_ours, t_theirs, t_sde))
    print(f"model: {model}  batch {args.batch}  steps {args.steps}  threads {args.threads}  repeats {args.repeats}")
    print(f"flowalign rollout (ODE): median {m_ours * 1000:.1f} ms")
    print(f"diffusers __call__:      median {m_theirs * 1000:.1f} ms")
    print(f"ratio rollout/diffusers: {m_ours / m_theirs:.3f}  (target <= 1.10)")
    print(f"SDE (flow_grpo) / ODE rollout: {m_sde / m_ours:.3f}")


class _Stopwatch:
    """Accumulates the wall time spent inside wrapped callables."""

    def __init__(self):
        self.seconds = 0.0

    def wrap(self, fn):
        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.seconds += time.perf_counter() - t0

        return timed


def _main_job(args: argparse.Namespace, trainer: str, run_dir: Path, *extra: str):
    from flowalign.config import load_config
    from flowalign.train import build_trainer

    overrides = [f"run.output_dir={run_dir}", "run.resume=never", "run.progress=false", "run.checkpoint_every=100000",
                 f"trainer.name={trainer}", "eval.bench=null", *extra]
    if run_dir.exists():
        import shutil

        shutil.rmtree(run_dir)
    return build_trainer(load_config(args.config, overrides))


def bench_train(args: argparse.Namespace) -> None:
    import resource

    torch.set_num_threads(args.threads)
    out = Path(args.out)
    # (1) overhead: time the model (every transformer forward, every backward, the decode) and the reward
    trainer = _main_job(args, "flow_grpo", out / "overhead")
    model_time, reward_time = _Stopwatch(), _Stopwatch()
    policy = trainer.policy
    policy.velocity = model_time.wrap(policy.velocity)
    policy.decode = model_time.wrap(policy.decode)
    trainer.rewards = [(n, w, reward_time.wrap(r)) for n, w, r in trainer.rewards]
    backward = torch.Tensor.backward
    torch.Tensor.backward = model_time.wrap(backward)
    try:
        trainer.train_step()  # warm-up
        model_time.seconds = reward_time.seconds = 0.0
        t0 = time.perf_counter()
        for _ in range(args.steps):
            trainer.step += 1
            trainer.train_step()
        total = time.perf_counter() - t0
    finally:
        torch.Tensor.backward = backward
    overhead = total - model_time.seconds - reward_time.seconds
    print(f"Flow-GRPO step on {args.config}: {total / args.steps:.2f} s/step over {args.steps} steps")
    print(f"  model forward/backward/decode {model_time.seconds / total:.1%}, reward {reward_time.seconds / total:.1%}, "
          f"toolkit overhead {overhead / total:.1%}  (target <= 10%)")
    print(f"  peak resident memory {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")

    # (2) reward against wall-clock for both trainers
    if args.minutes <= 0:
        return
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
    sub = parser.add_subparsers(dest="bench", required=True)
    p = sub.add_parser("rollout")
    p.add_argument("--model", default=None)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompt", default="a red circle")
    p = sub.add_parser("train")
    p.add_argument("--config", default="configs/tiny/flow_grpo_vvr.yaml")
    p.add_argument("--steps", type=int, default=5, help="timed steps for the overhead measurement")
    p.add_argument("--minutes", type=float, default=10.0, help="wall-clock per trainer for the curves (0: skip)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="runs/bench-train")
    args = parser.parse_args()
    {"rollout": bench_rollout, "train": bench_train}[args.bench](args)


if __name__ == "__main__":
    main()
