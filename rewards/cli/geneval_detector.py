"""``flowalign geneval-detector CHECKPOINT --out DIR``: GenEval's own mmdetection detector as the ``geneval``
reward's ``path`` (:mod:`rewards.geneval.mmdet_checkpoint`).

A folder holding other files is refused without ``--overwrite``; the folder it wrote before is its own.
"""

from __future__ import annotations

import argparse

from flowalign.cli.out_dir import add_out_dir_args


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("geneval-detector", help="convert GenEval's mmdetection Mask2Former checkpoint into the "
                                                "geneval reward's detector folder (offline)")
    p.add_argument("checkpoint", help="GenEval's mask2former_swin-s-p4-w7-224_lsj_8x2_50e_coco.pth (its "
                                      "evaluation/download_models.sh fetches it)")
    add_out_dir_args(p, "folder to write (give it to the geneval reward as path:)", "only its files are replaced")
    p.add_argument("--trust-pickle", action="store_true",
                   help="read a checkpoint that holds more than tensors and plain values (a pickle can run code)")
    return p


def run(args: argparse.Namespace) -> None:
    from flowalign.io import check_out_dir
    from rewards.geneval.mmdet_checkpoint import WRITER, convert_checkpoint

    check_out_dir(args.out, writer=WRITER, overwrite=args.overwrite)  # before the checkpoint is read
    out = convert_checkpoint(args.checkpoint, args.out, overwrite=args.overwrite, trust_pickle=args.trust_pickle)
    print(f"wrote GenEval's detector to {out} (load with {{name: geneval, path: {out}, clip_path: ...}})")
