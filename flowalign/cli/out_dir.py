"""The output folder of a command that writes one whole folder (``tiny``, ``tiny-reward``): ``--out`` and
``--overwrite``, read by :func:`flowalign.io.check_out_dir` and :func:`flowalign.io.atomic_dir` (a non-empty
folder the command did not write is refused unless ``--overwrite``; then only the command's files are replaced)."""

from __future__ import annotations

import argparse


def add_out_dir_args(p: argparse.ArgumentParser, out_help: str, replaced: str) -> None:
    """``--out`` (required, described by ``out_help``) and ``--overwrite``; ``replaced`` says which files an
    overwrite replaces."""
    p.add_argument("--out", required=True, help=out_help)
    p.add_argument("--overwrite", action="store_true",
                   help=f"write into a non-empty --out this command did not write ({replaced}; other files are kept)")
