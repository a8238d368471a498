"""``flowalign tiny FAMILY --out DIR``: write a tiny, randomly initialised diffusers folder.

FAMILY: sd3, flux, wan or a twin of :mod:`pipelines.tiny_twins` (qwen_image, flux2, zimage, wan22, ...).
"""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("tiny", help="build a tiny architecture-faithful model folder (offline)")
    from pipelines.tiny import twins

    p.add_argument("family", choices=list(twins()))
    p.add_argument("--out", required=True, help="folder to write (diffusers format)")
    p.add_argument("--seed", type=int, default=0)
    return p


def run(args: argparse.Namespace) -> None:
    from pipelines.tiny import save_tiny

    save_tiny(args.family, args.out, seed=args.seed)
    print(f"wrote tiny {args.family} model to {args.out}")
