"""``make demo``: fine-tune the embedded tiny model with Flow-GRPO on VVR, then print before/after.

    python scripts/demo.py [--config configs/tiny/flow_grpo_vvr.yaml] [key=value ...]

Runs the main job as shipped (resuming if its run folder already holds a checkpoint), then prints the
held-out VVR accuracy before and after training and the path of the evaluation gallery.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


from flowalign.config import load_config  # noqa: E402
from flowalign.errors import UserError  # noqa: E402
from flowalign.train import train  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/tiny/flow_grpo_vvr.yaml")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    try:
        cfg = load_config(args.config, args.overrides)
        run_dir = Path(cfg.run.output_dir)
        print(f"training {cfg.run.name}: {args.config} -> {run_dir}")
        t0 = time.time()
        final = train(cfg)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    before = json.loads((run_dir / "evals" / "step-000000" / "metrics.json").read_text())
    minutes = (time.time() - t0) / 60
    print(f"\nheld-out {before.get('bench', 'eval')} ({before['n']} tasks), {minutes:.1f} min:")
    for key in ("accuracy", "mean_score"):
        if key in before and key in final:
            print(f"  {key:<11} before {before[key]:.3f}   after {final[key]:.3f}   ({final[key] - before[key]:+.3f})")
    gallery = run_dir / "gallery" / "index.html"
    if gallery.exists():
        print(f"gallery: {gallery.resolve()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
