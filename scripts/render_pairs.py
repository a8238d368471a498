"""Rendered preference pairs for reward training: a VVR task's own scene (chosen) against the same scene
with one object changed so that the verifier fails it (rejected; ``rewards.vvr.near_miss``).

Writes ``OUT/pairs.jsonl`` (one ``{prompt, chosen, rejected, margin, task}`` per line, image paths relative
to OUT) and ``OUT/images/``; ``flowalign train-reward --pairs OUT/pairs.jsonl`` encodes them with the
model being rewarded. Tasks are drawn fresh with ``--seed`` (keep it below 1000: the benchmark splits
use seeds from 1000 up).

    python scripts/render_pairs.py --level easy medium --n 2000 --per-task 2 --seed 60 --out runs/render_pairs
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tqdm.auto import tqdm


from flowalign.io import atomic_path  # noqa: E402
from rewards.vvr import generate_tasks  # noqa: E402
from rewards.vvr.near_miss import rendered_pairs  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--level", nargs="+", default=["medium"], choices=["easy", "medium", "hard"])
    parser.add_argument("--n", type=int, default=1000, help="tasks per level")
    parser.add_argument("--per-task", type=int, default=1, help="near misses per task (each one pair)")
    parser.add_argument("--size", type=int, default=64, help="image size in pixels (the model's resolution)")
    parser.add_argument("--seed", type=int, default=0, help="task and mutation seed (< 1000)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if args.seed >= 1000:
        parser.error(f"--seed {args.seed}: seeds >= 1000 draw the benchmark splits; use a training seed below 1000")
    out = Path(args.out)
    (out / "images").mkdir(parents=True, exist_ok=True)
    rows = []
    for level in args.level:
        tasks = generate_tasks(args.n, seed=args.seed, level=level)
        pairs = rendered_pairs(tasks, seed=args.seed, size=args.size, per_task=args.per_task)
        written: set[str] = set()
        for j, (task, chosen, rejected, margin) in enumerate(tqdm(pairs, desc=f"rendering {level} pairs", unit="pair")):
            good, bad = f"images/{task.id}.png", f"images/{task.id}-miss{j}.png"
            if good not in written:
                with atomic_path(out / good) as tmp:
                    chosen.save(tmp, format="PNG")
                written.add(good)
            with atomic_path(out / bad) as tmp:
                rejected.save(tmp, format="PNG")
            rows.append({"prompt": task.prompt, "chosen": good, "rejected": bad, "margin": round(margin, 4),
                         "task": task.to_dict()})
    with atomic_path(out / "pairs.jsonl") as tmp:
        Path(tmp).write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"{len(rows)} pairs ({len({r['prompt'] for r in rows})} prompts) -> {out / 'pairs.jsonl'}")


if __name__ == "__main__":
    main()
