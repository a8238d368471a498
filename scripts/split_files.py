"""Writing a benchmark's fixed split files, shared by the ``make_*_splits.py`` scripts: the common command line
(``--n``, ``--out``), and each split written as one JSON object per line, atomically, with a line saying what
it holds. Deterministic in, identical bytes out: rerunning a script rewrites the same files."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from flowalign.io import atomic_path

ASSETS = Path(__file__).resolve().parent.parent / "assets"


def split_arguments(doc: str, benchmark: str, size: int, n_help: str,
                    argv: list[str] | None = None) -> argparse.Namespace:
    """``--n`` (default ``size``) and ``--out`` (default ``assets/<benchmark>``), described by ``doc``'s first
    paragraph."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=size, help=n_help)
    parser.add_argument("--out", type=Path, default=ASSETS / benchmark)
    return parser.parse_args(argv)


def write_split(path: Path, rows: list[dict[str, Any]], summary: str, *, sort_keys: bool = True) -> None:
    """``rows`` as JSON lines at ``path`` (its folder made), then ``path: summary`` on stdout."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        tmp.write_text("".join(json.dumps(row, sort_keys=sort_keys) + "\n" for row in rows))
    print(f"{path}: {summary}")


def write_level_splits(out: Path, seeds: Mapping[str, Mapping[str, int]],
                       draw: Callable[[str, str, int, int], list[Any]], n: int) -> None:
    """``out/<level>/<split>.jsonl`` for every ``seeds[split][level]``: the tasks ``draw(level, split, n, seed)``
    gives (each with ``to_dict()`` and ``prompt``), and how many of their prompts are distinct."""
    for split, by_level in seeds.items():
        for level, seed in by_level.items():
            tasks = draw(level, split, n, seed)
            write_split(out / level / f"{split}.jsonl", [t.to_dict() for t in tasks],
                        f"{len(tasks)} tasks, {len({t.prompt for t in tasks})} distinct prompts (seed {seed})")
