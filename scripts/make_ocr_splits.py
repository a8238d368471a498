"""Write the fixed OCR benchmark splits: ``assets/ocr/<level>/{validation,test}.jsonl``.

    python scripts/make_ocr_splits.py [--n 500] [--out assets/ocr]

One ``OCRTask.to_dict()`` per line (``prompt``, ``text``, ``template``), 500 prompts per split and level,
drawn with the fixed seeds ``rewards.ocr.splits.SPLIT_SEEDS``: ``test`` holds only prompts with a held-out
(template, word) pair (``rewards.ocr.prompts``, never produced for training), ``validation`` is drawn
from the training distribution with its own seeds. Deterministic: rerunning rewrites identical files.
"""

from __future__ import annotations

from rewards.ocr.splits import SPLIT_SEEDS, draw_split
from rewards.vvr.splits import SPLIT_SIZE
from split_files import split_arguments, write_level_splits


def main(argv: list[str] | None = None) -> None:
    args = split_arguments(__doc__, "ocr", SPLIT_SIZE, "prompts per split and level", argv)
    write_level_splits(args.out, SPLIT_SEEDS, draw_split, args.n)


if __name__ == "__main__":
    main()
