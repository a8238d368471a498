"""``flowalign evaluate``: score a model (and adapter) on a benchmark split; writes metrics.json."""

from __future__ import annotations

import argparse

from flowalign import strict_json
from flowalign.cli.common import (
    add_guide_args,
    add_model_args,
    add_sampling_args,
    check_guide_args,
    check_positive,
    load_guided_policy,
)
from flowalign.evaluation import evaluate
from flowalign.io import check_out_dir
from flowalign.paths import default_model_dir


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("evaluate", help="evaluate on a benchmark split (metrics.json, samples, verdicts)")
    add_model_args(p)
    p.add_argument("--bench", default="vvr", help="benchmark name: vvr (images), vvr_motion (videos) or vvr_edit (editing models)")
    p.add_argument("--level", default="easy", help="easy, medium or hard")
    p.add_argument("--split", default="test",
                   help="validation (choose settings on it) or test (held-out compositions; report results on it)")
    p.add_argument("--n", type=int, default=None, help="number of tasks (default: the whole split)")
    p.add_argument("--seed", type=int, default=None,
                   help="draw a fresh split of the same distribution with this seed instead of the shipped one (also seeds the noise)")
    add_sampling_args(p)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--overwrite", action="store_true",
                   help="write into a non-empty --out that holds no earlier evaluation (only metrics.json, "
                        "results.jsonl and samples/ are replaced; other files are kept)")
    add_guide_args(p)
    return p


def run(args: argparse.Namespace) -> None:
    from flowalign.benchmarks import load_benchmark

    check_positive(args, "steps", "batch_size", "n")
    bench = load_benchmark(args.bench, args.level, args.n, args.seed, split=args.split)
    check_guide_args(args)
    check_out_dir(args.out, writer="evaluate", overwrite=args.overwrite)  # before the model is loaded
    policy, guide = load_guided_policy(args)
    labels = {}
    if guide is not None:
        from flowalign.sampling.guidance import GuidedPolicy

        policy = GuidedPolicy(policy, guide)  # every sampling step of the evaluation is reward-guided
        labels = {"guide": args.guide, "guide_scale": args.guide_scale, "guide_window": args.guide_window}
    metrics = evaluate(policy, bench.prompts, bench.metadata, bench.reward, seed=args.seed or 0,
                       num_steps=args.steps, guidance_scale=args.guidance, batch_size=args.batch_size,
                       out_dir=args.out, overwrite=args.overwrite, labels={"bench": bench.name, "split": bench.split, "seed": args.seed or 0, "reward": bench.reward.name, "model": str(args.model or default_model_dir()), "adapter": args.adapter, **labels})
    print(strict_json.dumps({k: v for k, v in metrics.items() if k != "per_constraint"}, indent=2))
    print(f"wrote {args.out}/metrics.json")
