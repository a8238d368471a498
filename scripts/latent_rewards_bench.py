"""Measurements for docs/latent_rewards.md (latent reward registers, RGS, RG-OPD, CoRe) on the tiny model.

    python scripts/latent_rewards_bench.py merge OUT.safetensors PAIRS.safetensors...
    python scripts/latent_rewards_bench.py split PAIRS.safetensors TRAIN.safetensors TEST.safetensors [--test-fraction 0.2]
    python scripts/latent_rewards_bench.py by-failure --pairs TEST.safetensors REWARD_DIR... [--sigma 0.5]
    python scripts/latent_rewards_bench.py rgs --reward DIR --kappa 0.1 [--n 96] [--window 0.2 1.0] [--record FILE]
    python scripts/latent_rewards_bench.py curves RUN_DIR...      # held-out accuracy, latent score vs minutes

``rgs``: the first N held-out medium tasks (``assets/vvr/medium.jsonl``), ODE sampling at the model's
defaults with the noise of ``flowalign evaluate`` (seed 0), every step reward-guided with κ; reports the
verifier's accuracy, the partial-credit VVR score (objects drawn right + relations) and the latent score
of the final samples, and appends one JSON line to ``--record``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def merge(args: argparse.Namespace) -> None:
    from flowalign.latent_preference import PreferencePairs

    parts = [PreferencePairs.load(p) for p in args.inputs]
    merged = PreferencePairs.cat(parts)
    merged.save(args.out)
    print(f"{len(merged)} pairs ({len(set(merged.prompts))} prompts) -> {args.out}")


def split(args: argparse.Namespace) -> None:
    """The prompt split ``train-reward`` makes by itself (same fraction and seed), written out, so that
    registers trained on other pairs are scored on exactly the held-out pairs of earlier runs."""
    from flowalign.latent_preference import PreferencePairs

    train, test = PreferencePairs.load(args.pairs).split(args.test_fraction, seed=args.seed)
    train.save(args.train)
    test.save(args.test)
    print(f"{len(train)} train pairs -> {args.train}; {len(test)} held-out pairs ({len(set(test.prompts))} prompts) -> {args.test}")


def failure_kind(prompt: str, rejected: torch.Tensor) -> str:
    """What is wrong with a pair's decoded rejected sample ``(3, H, W)`` in [0, 1], as the VVR segmenter sees
    it (one-object prompts, "a <colour> <shape>"); "two-object prompt" for the rest."""
    from rewards.vvr.segment import segment

    if not prompt.startswith(("a ", "an ")):
        return "two-object prompt"
    colour = prompt.split()[1]
    found = segment((rejected.permute(1, 2, 0).clamp(0, 1).numpy() * 255).astype("uint8")).components
    if not found:
        return "no object"
    return "right colour, wrong shape" if any(c.colour == colour for c in found) else "wrong colour"


def by_failure(args: argparse.Namespace) -> None:
    """Held-out pairwise accuracy at one σ, split by what is wrong with the rejected sample."""
    import numpy as np

    import pipelines
    from flowalign.latent_preference import PreferencePairs, noised_scores
    from rewards.latent_registers import LatentRegisters

    policy = pipelines.load(args.model)
    pairs = PreferencePairs.load(args.pairs)
    with torch.no_grad():  # the policy decodes in batches of its own decode_batch_size
        rejected = policy.decode(pairs.rejected).cpu()
    kinds = np.array([failure_kind(p, image) for p, image in zip(pairs.prompts, rejected)])
    noise = torch.randn(pairs.chosen.shape, generator=torch.Generator().manual_seed(1))
    for directory in args.rewards:
        reward = LatentRegisters.load(directory)
        right = []
        with torch.no_grad():
            for start in range(0, len(pairs), 32):
                idx = list(range(start, min(start + 32, len(pairs))))
                part = pairs.select(idx)
                r_w, r_l = noised_scores(reward, part, policy.encode(part.prompts), torch.full((len(idx),), args.sigma), noise[idx])
                right += ((r_w > r_l).float() + 0.5 * (r_w == r_l).float()).tolist()
        right = np.array(right)
        for kind in sorted(set(kinds)):
            print(f"{directory}  {kind}: {int((kinds == kind).sum())} pairs, {100 * right[kinds == kind].mean():.1f} %")


def rgs(args: argparse.Namespace) -> None:
    import pipelines
    import rewards
    from flowalign.evaluation import sample_seeded
    from flowalign.sampling import Guidance, GuidedPolicy, load_latent_reward
    from flowalign.benchmarks import load_benchmark

    torch.set_num_threads(1)
    policy = pipelines.load("assets/tiny-sd3-vvr")
    latent = load_latent_reward(args.reward)
    bench = load_benchmark("vvr", "medium", args.n, None)
    guided = GuidedPolicy(policy, Guidance(latent, args.kappa, tuple(args.window) if args.window else None))
    t0 = time.perf_counter()
    samples = sample_seeded(guided, bench.prompts, seed=0, batch_size=16, progress=False)
    minutes = (time.perf_counter() - t0) / 60
    plain = bench.reward(samples, bench.prompts, bench.metadata)
    partial = rewards.load("vvr", partial_credit=True)(samples, bench.prompts, bench.metadata)
    # the latent score of the clean samples, re-encoded (the sampler's own final latents are not returned)
    from rewards.latent_registers import encode_images

    with torch.no_grad():
        x0 = encode_images(policy, samples)
        score = torch.cat([latent.score(x0[i : i + 16], 0.0, policy.encode(bench.prompts[i : i + 16]))
                           for i in range(0, len(x0), 16)])
    row = {"kappa": args.kappa, "window": args.window, "n": args.n, "reward": str(args.reward),
           "accuracy": sum(bool(i["all_passed"]) for i in plain.info) / args.n,
           "partial_credit": partial.total.mean().item(), "latent_score": score.mean().item(), "minutes": minutes}
    print(json.dumps(row))
    if args.per_task:  # per-task verdicts, for a paired comparison of two κ on the same noise
        Path(args.per_task).write_text(json.dumps([bool(i["all_passed"]) for i in plain.info]))
    if args.record:
        with open(args.record, "a") as f:
            f.write(json.dumps(row) + "\n")


def curves(args: argparse.Namespace) -> None:
    for run in args.runs:
        rows = [json.loads(line) for line in (Path(run) / "metrics.jsonl").read_text().splitlines() if line.strip()]
        print(f"== {run}")
        minutes = 0.0
        for row in rows:
            minutes = row.get("time/train_minutes", minutes)
            acc = row.get("eval/accuracy")
            if acc is not None:
                print(f"step {row.get('step', '?'):>4}  train-min {minutes:6.2f}  eval accuracy {acc:.3f}")
        keys = ("latent/score", "reward/vvr")
        for k in keys:
            vals = [(r.get("step"), r[k]) for r in rows if k in r]
            if vals:
                chunk = max(1, len(vals) // 10)
                means = [sum(v for _, v in vals[i : i + chunk]) / len(vals[i : i + chunk]) for i in range(0, len(vals), chunk)]
                print(f"{k} ({chunk}-step means): " + " ".join(f"{m:.3f}" for m in means))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("merge")
    m.add_argument("out")
    m.add_argument("inputs", nargs="+")
    sp = sub.add_parser("split")
    sp.add_argument("pairs")
    sp.add_argument("train")
    sp.add_argument("test")
    sp.add_argument("--test-fraction", type=float, default=0.2)
    sp.add_argument("--seed", type=int, default=0)
    b = sub.add_parser("by-failure")
    b.add_argument("rewards", nargs="+")
    b.add_argument("--pairs", required=True)
    b.add_argument("--model", default="assets/tiny-sd3-vvr")
    b.add_argument("--sigma", type=float, default=0.5)
    r = sub.add_parser("rgs")
    r.add_argument("--reward", required=True)
    r.add_argument("--kappa", type=float, required=True)
    r.add_argument("--n", type=int, default=96)
    r.add_argument("--window", type=float, nargs=2, default=None)
    r.add_argument("--record", default=None)
    r.add_argument("--per-task", default=None, help="write each task's all-passed verdict (JSON list) here")
    c = sub.add_parser("curves")
    c.add_argument("runs", nargs="+")
    args = p.parse_args()
    {"merge": merge, "split": split, "by-failure": by_failure, "rgs": rgs, "curves": curves}[args.cmd](args)


if __name__ == "__main__":
    main()
