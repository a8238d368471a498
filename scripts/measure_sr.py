"""Super-resolution numbers of model folders on an ``sr`` split: PSNR / SSIM to the HR scene, the perceptual
gain over the bicubic upscale (Laplacian-energy ratio, the ``compass`` gain), fidelity to the LR input and
the ``compass`` / ``compass_fr`` scores, each the mean over the split, for every sampling seed.

    python scripts/measure_sr.py --model assets/tiny-kontext-sr runs/oars_1_coldstart/model \
        --level medium --split test --seeds 0 1 2 --out runs/oars-measure.json

The first row, ``bicubic``, is the LR image upscaled bicubically (no model): what a model must beat.
Sample ``i`` of seed ``s`` gets the noise of ``s·100000 + i`` (:func:`flowalign.evaluation.sample_seeded`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

METRICS = ("psnr", "ssim", "gain", "fidelity", "compass", "compass_fr")


def measure(samples: torch.Tensor, metadata: list[dict]) -> dict[str, float]:
    """Mean of each metric over the split for samples ``(N, 3, H, W)``."""
    from rewards.compass import CompassFR

    parts = CompassFR().score(samples.float().clamp(0, 1), [""] * len(samples), metadata)
    return {k: round(float(parts[k].mean()), 4) for k in METRICS}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", nargs="+", required=True, help="model folders (diffusers, with flowalign.json)")
    p.add_argument("--level", default="medium", choices=("easy", "medium", "hard"))
    p.add_argument("--split", default="test", choices=("validation", "test"))
    p.add_argument("--n", type=int, default=100, help="tasks of the split (from the first)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--num-steps", type=int, default=None, help="sampling steps (default: each model's own)")
    p.add_argument("--out", default=None, help="JSON file of the numbers")
    args = p.parse_args(argv)
    if not 1 <= args.n <= 1000 or (args.num_steps is not None and not 1 <= args.num_steps <= 1000):
        print("error: --n and --num-steps must lie in 1..1000", file=sys.stderr)
        return 2
    import pipelines
    from flowalign.benchmarks import load_benchmark
    from flowalign.evaluation import sample_seeded
    from flowalign.sampling.inputs import load_input_image
    from rewards.compass import resize
    from rewards.sr import HR_SIZE

    bench = load_benchmark("sr", args.level, n=args.n, split=args.split)
    rows = {"bicubic": [measure(torch.cat([resize(load_input_image(m["image"])[None], (HR_SIZE, HR_SIZE))
                                           for m in bench.metadata]), bench.metadata)]}
    for model in args.model:
        policy = pipelines.load(model)
        rows[model] = [measure(sample_seeded(policy, bench.prompts, seed=100000 * s, num_steps=args.num_steps,
                                             metadata=bench.metadata, progress=False), bench.metadata)
                       for s in args.seeds]
    for name, per_seed in rows.items():
        mean = {k: sum(r[k] for r in per_seed) / len(per_seed) for k in METRICS}
        spread = {k: max(r[k] for r in per_seed) - min(r[k] for r in per_seed) for k in METRICS}
        print(f"{name}: " + "  ".join(f"{k} {mean[k]:.3f}±{spread[k] / 2:.3f}" for k in METRICS))
    if args.out:
        from flowalign.io import write_json

        write_json(Path(args.out), {"level": args.level, "split": args.split, "n": args.n, "seeds": args.seeds,
                                    "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
