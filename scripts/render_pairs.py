"""Rendered preference pairs for reward training: a VVR task's own scene (chosen) against the same scene
with one object changed so that the verifier fails it (rejected; ``rewards.vvr.near_miss``).

Writes ``OUT/pairs.jsonl`` (one ``{prompt, chosen, rejected, margin, task}`` per line, image paths relative
to OUT) and ``OUT/images/``; ``flowalign train-reward --pairs OUT/pairs.jsonl`` encodes them with the
model being rewarded. Tasks are drawn fresh with ``--seed`` (keep it below 1000: the benchmark splits
use seeds from 1000 up).

    python scripts/render_pairs.py --level easy medium --n 2000 --per-task 2 --seed 60 --out runs/render_pairs

An ``--out`` that already holds files is refused unless ``--overwrite``; the folder is written atomically.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tqdm.auto import tqdm

from flowalign.errors import UserError
from flowalign.io import MARKER_PREFIX, atomic_dir
from rewards.vvr import generate_tasks
from rewards.vvr.near_miss import rendered_pairs

#: the writer name of the folders this script writes (:func:`flowalign.io.atomic_dir`)
WRITER = "render-pairs"


def check_out(out: Path, overwrite: bool) -> None:
    """Refuse (``UserError``) an ``--out`` that is a file, or a folder that already holds files (its own
    earlier pairs too: a rendering can take hours), unless ``overwrite``."""
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file; give a folder to write the pairs into")
    # the hidden marker that lists what it wrote before is not shown: the entries beside it are
    held = sorted(p.name for p in out.iterdir() if not p.name.startswith(MARKER_PREFIX)) if out.is_dir() else []
    if held and not overwrite:
        shown = ", ".join(held[:3]) + (", ..." if len(held) > 3 else "")
        raise UserError(f"--out {out} already holds files ({shown}); choose a new or empty folder, or pass "
                        "--overwrite to replace the pairs this script writes (other files are kept)")


def render(out: Path, levels: list[str], n: int, per_task: int, size: int, seed: int,
           overwrite: bool = False) -> list[dict]:
    """Render the pairs of ``n`` tasks of each level into ``out`` (``pairs.jsonl`` and ``images/``); returns the
    JSONL's rows. The folder is written atomically: it appears (or its pairs are replaced) only once every image and
    the JSONL are written, so an interrupted run leaves ``out`` as it was."""
    check_out(out, overwrite)  # before hours of rendering
    rows = []
    with atomic_dir(out, writer=WRITER, overwrite=overwrite) as tmp:
        (tmp / "images").mkdir()
        for level in levels:
            tasks = generate_tasks(n, seed=seed, level=level)
            pairs = rendered_pairs(tasks, seed=seed, size=size, per_task=per_task)
            written: set[str] = set()
            for j, (task, chosen, rejected, margin) in enumerate(tqdm(pairs, desc=f"rendering {level} pairs",
                                                                      unit="pair")):
                good, bad = f"images/{task.id}.png", f"images/{task.id}-miss{j}.png"
                if good not in written:
                    chosen.save(tmp / good, format="PNG")
                    written.add(good)
                rejected.save(tmp / bad, format="PNG")
                rows.append({"prompt": task.prompt, "chosen": good, "rejected": bad, "margin": round(margin, 4),
                             "task": task.to_dict()})
        (tmp / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--level", nargs="+", default=["medium"], choices=["easy", "medium", "hard"])
    parser.add_argument("--n", type=int, default=1000, help="tasks per level")
    parser.add_argument("--per-task", type=int, default=1, help="near misses per task (each one pair)")
    parser.add_argument("--size", type=int, default=64, help="image size in pixels (the model's resolution)")
    parser.add_argument("--seed", type=int, default=0, help="task and mutation seed (< 1000)")
    parser.add_argument("--out", required=True, help="a new or empty folder to write the pairs into")
    parser.add_argument("--overwrite", action="store_true",
                        help="write into a non-empty --out (the pairs and images this script writes are replaced; "
                             "other files are kept)")
    args = parser.parse_args(argv)
    if args.seed >= 1000:
        parser.error(f"--seed {args.seed}: seeds >= 1000 draw the benchmark splits; use a training seed below 1000")
    out = Path(args.out)
    try:
        rows = render(out, args.level, args.n, args.per_task, args.size, args.seed, overwrite=args.overwrite)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"{len(rows)} pairs ({len({r['prompt'] for r in rows})} prompts) -> {out / 'pairs.jsonl'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
