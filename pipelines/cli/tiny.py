"""``flowalign tiny FAMILY --out DIR``: write a tiny, randomly initialised diffusers folder.

FAMILY: sd3, flux, wan or a twin of :mod:`pipelines.tiny_twins` (qwen_image, flux2, zimage, wan22, ...).
A folder holding other files (a model's weights, say) is refused without ``--overwrite``; the folder
it wrote before is its own (its marker file lists the entries it replaces).
"""

from __future__ import annotations

import argparse

from flowalign.cli.common import add_choice, add_number
from flowalign.cli.out_dir import add_out_dir_args
from flowalign.limits import MAX_SEED

#: the writer name of the folders this command writes (:func:`flowalign.io.atomic_dir`)
WRITER = "tiny"


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("tiny", help="build a tiny architecture-faithful model folder (offline)")
    add_choice(p, "family", choices=tiny_model_names)
    add_out_dir_args(p, "folder to write (diffusers format)", "only the model's files are replaced")
    add_number(p, "--seed", type=int, lo=0, hi=MAX_SEED, default=0)
    return p


def tiny_model_names() -> list[str]:
    """The tiny models the registered families name (read from their specs, which import diffusers)."""
    from pipelines.tiny import twins

    return list(twins())


def run(args: argparse.Namespace) -> None:
    from pathlib import Path

    from flowalign.disk_space import explain_no_space
    from flowalign.io import atomic_dir, check_out_dir
    from pipelines.tiny import build_tiny, pipeline_bytes, save_tiny

    check_out_dir(args.out, writer=WRITER, overwrite=args.overwrite)  # before the model is built
    pipe = build_tiny(args.family, seed=args.seed)
    # the writers' own "no space" errors (safetensors' among them) become one line; atomic_dir removes its
    # temporary folder on the way out, so a full disk leaves the --out folder as it was
    with explain_no_space(Path(args.out), pipeline_bytes(pipe), f"the tiny {args.family} model"), \
            atomic_dir(args.out, writer=WRITER, overwrite=args.overwrite) as tmp:
        save_tiny(args.family, tmp, seed=args.seed, pipe=pipe)
    print(f"wrote tiny {args.family} model to {args.out}")
