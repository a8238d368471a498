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
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flowalign.cli.compare import read_results as read  # noqa: E402
from flowalign.io import write_jsonl  # noqa: E402


def passed_rows(folder: Path, results: list[dict], min_score: float | None) -> list[dict]:
    """``{"image", "prompt"}`` rows of the valid samples in ``results`` (``folder``'s ``results.jsonl``,
    as :func:`flowalign.cli.compare.read_results` gives it) that passed, or scored ≥ ``min_score``."""
    return [{"image": str((folder / r["file"]).resolve()), "prompt": r["prompt"]} for r in results
            if r["valid"] and (r["all_passed"] if min_score is None else r["score"] >= min_score)]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folders", nargs="+", type=Path, help="flowalign evaluate output folders")
    ap.add_argument("--out", type=Path, required=True, help="JSONL to write")
    ap.add_argument("--min-score", type=float, default=None, help="keep samples scoring at least this (default: all passed)")
    args = ap.parse_args(argv)

    rows = []
    for folder in args.folders:
        if not (folder / "results.jsonl").is_file():
            raise SystemExit(f"{folder}: no results.jsonl; give folders written by `flowalign evaluate --out`")
        results = read(folder)
        kept = passed_rows(folder, results, args.min_score)
        print(f"{folder}: {len(kept)} of {len(results)} samples kept")
        rows += kept
    if not rows:
        raise SystemExit("no sample passed; nothing to write")
    write_jsonl(args.out, rows)
    print(f"{args.out}: {len(rows)} pairs")


if __name__ == "__main__":
    main()
