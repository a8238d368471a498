"""Write the fixed OCR benchmark splits: ``assets/ocr/<level>/{validation,test}.jsonl``.

    python scripts/make_ocr_splits.py [--n 500] [--out assets/ocr]

One ``OCRTask.to_dict()`` per line (``prompt``, ``text``, ``template``), 500 prompts per split and level,
drawn with the fixed seeds ``rewards.ocr.splits.SPLIT_SEEDS``: ``test`` holds only prompts with a held-out
(template, word) pair (``rewards.ocr.prompts``, never produced for training), ``validation`` is drawn
from the training distribution with its own seeds. Deterministic: rerunning rewrites identical files.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from flowalign.io import atomic_path
from rewards.ocr.splits import SPLIT_SEEDS, draw_split
from rewards.vvr.splits import SPLIT_SIZE


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=SPLIT_SIZE, help="prompts per split and level")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "assets" / "ocr")
    args = parser.parse_args(argv)
    for split, seeds in SPLIT_SEEDS.items():
        for level, seed in seeds.items():
            tasks = draw_split(level, split, args.n, seed)
            path = args.out / level / f"{split}.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            with atomic_path(path) as tmp:
                tmp.write_text("".join(json.dumps(t.to_dict(), sort_keys=True) + "\n" for t in tasks))
            print(f"{path}: {len(tasks)} prompts, {len({t.prompt for t in tasks})} distinct (seed {seed})")


if __name__ == "__main__":
    main()
