"""The model's own verified samples as (image, caption) pairs: rejection-sampling fine-tuning data.

    flowalign evaluate --level medium --n 1600 --seed 901 --out runs/pool     # training seeds are < 1000
    python scripts/passed_pairs.py runs/pool [MORE_EVAL_DIRS ...] --out runs/pool/passed.jsonl
    flowalign train configs/tiny/sft_vvr.yaml trainer.pairs=runs/pool/passed.jsonl

Each folder is what ``flowalign evaluate --out`` writes. A sample is kept when the verifier passed all its
constraints (or, with ``--min-score``, when its score reaches that value). The JSONL has one
``{"image", "prompt"}`` line per kept sample, with absolute image paths, which is what ``trainer.pairs``
of the SFT/SOAR trainer reads. Prints how many samples each folder gave.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path


def passed_rows(folder: Path, min_score: float | None) -> list[dict]:
    """``{"image", "prompt"}`` rows of ``folder``'s valid samples that passed (or scored ≥ ``min_score``)."""
    results = folder / "results.jsonl"
    if not results.is_file():
        raise SystemExit(f"{folder}: no results.jsonl; give folders written by `flowalign evaluate --out`")
    rows = []
    for line in results.read_text().splitlines():
        if not line.strip():
            continue
        r = json.loads(line)
        keep = r["all_passed"] if min_score is None else r["score"] >= min_score
        if r["valid"] and keep:
            rows.append({"image": str((folder / r["file"]).resolve()), "prompt": r["prompt"]})
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folders", nargs="+", type=Path, help="flowalign evaluate output folders")
    ap.add_argument("--out", type=Path, required=True, help="JSONL to write")
    ap.add_argument("--min-score", type=float, default=None, help="keep samples scoring at least this (default: all passed)")
    args = ap.parse_args(argv)

    rows = []
    for folder in args.folders:
        kept = passed_rows(folder, args.min_score)
        total = sum(1 for line in (folder / "results.jsonl").read_text().splitlines() if line.strip())
        print(f"{folder}: {len(kept)} of {total} samples kept")
        rows += kept
    if not rows:
        raise SystemExit("no sample passed; nothing to write")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(args.out.suffix + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    os.replace(tmp, args.out)
    print(f"{args.out}: {len(rows)} pairs")


if __name__ == "__main__":
    main()
