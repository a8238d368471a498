"""Static HTML evaluation galleries: one row per prompt, one column per checkpoint or adapter.

A gallery is a self-contained folder (``index.html`` + ``media/``) that works opened from disk or
served from anywhere: media are hard-linked (copied across file systems) under ``media/`` and
referenced by relative path. Each cell shows the sample, its scores and, for VVR-style rewards, the
per-constraint verdicts; a summary table (mean score, accuracy per column) sits on top, and the rows
sort by reward gain (last column minus first) or by prompt with a few lines of inline JS
(:mod:`flowalign.gallery_html` writes the page).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from pathlib import Path
from typing import Any
from urllib.parse import quote

from flowalign.errors import UserError
from flowalign.gallery_cells import GalleryCell, GalleryRow, Placed
from flowalign.gallery_html import render_page
from flowalign.io import atomic_dir, atomic_path
from flowalign.media import IMAGE_SUFFIXES

# the folder name trainers give the evaluation at a step: runs/NAME/evals/step-000100/
STEP_DIR = re.compile(r"step-(\d{6})")


# --------------------------------------------------------------------------------------------- loaders


def gallery_from_evals(eval_dirs: list[Path], labels: list[str]) -> tuple[list[str], list[GalleryRow]]:
    """Columns and rows from folders written by ``flowalign.evaluation.evaluate(..., out_dir=D)``.

    Rows are matched across folders by ``(index, prompt)``; a prompt missing from a folder gets an
    empty cell there. Returns ``(labels, rows)``, ready for :func:`write_gallery`.
    """
    if not eval_dirs:
        raise UserError("no evaluation folders given; pass the folders written by `flowalign evaluate --out`")
    if len(labels) != len(eval_dirs):
        raise UserError(f"got {len(labels)} labels for {len(eval_dirs)} evaluation folders; give one label per folder")
    evals = [_read_eval(Path(d)) for d in eval_dirs]
    keys: dict[tuple[int, str], None] = {}  # insertion-ordered set: first folder's order, then new prompts
    for _, results in evals:
        keys.update(dict.fromkeys(results))
    rows = []
    for index, prompt in keys:
        cells = [results.get((index, prompt)) for _, results in evals]
        # evaluate() gives sample i the noise of seed + i; show it only when every column agrees
        seeds = {m["seed"] + index for m, r in evals if (index, prompt) in r and isinstance(m.get("seed"), int)}
        rows.append(GalleryRow(prompt, cells, seeds.pop() if len(seeds) == 1 else None))
    return list(labels), rows


def gallery_from_run(run_dir: Path) -> tuple[list[str], list[GalleryRow]]:
    """The finished evaluations of a training run (``RUN/evals/step-XXXXXX/``), in step order.

    A step folder without ``results.jsonl`` and ``metrics.json`` is still being written and is skipped.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise UserError(f"--run {run_dir}: no such folder; give a training run folder such as runs/NAME")
    evals_dir = run_dir / "evals"
    steps = sorted(
        (int(m.group(1)), p)
        for p in (evals_dir.iterdir() if evals_dir.is_dir() else [])
        if (m := STEP_DIR.fullmatch(p.name)) and (p / "results.jsonl").is_file() and (p / "metrics.json").is_file()
    )
    if not steps:
        raise UserError(f"{evals_dir}: no finished evaluations (step-XXXXXX folders); "
                        "enable evaluation in the run's config or pass --evals folders")
    return gallery_from_evals([p for _, p in steps], [f"step {s}" for s, _ in steps])


def _read_eval(folder: Path) -> tuple[dict[str, Any], dict[tuple[int, str], GalleryCell]]:
    """``metrics.json`` and the cells of ``results.jsonl`` keyed by ``(index, prompt)``."""
    if not folder.is_dir():
        raise UserError(f"{folder}: no such evaluation folder; give a folder written by `flowalign evaluate --out`")
    results_path = folder / "results.jsonl"
    if not results_path.is_file():
        raise UserError(f"{folder} has no results.jsonl; give a folder written by `flowalign evaluate --out`")
    metrics_path = folder / "metrics.json"
    metrics = json.loads(metrics_path.read_text()) if metrics_path.is_file() else {}
    score_name = _score_name(metrics)
    cells = {}
    for line_no, line in enumerate(results_path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            key = (int(row["index"]), str(row["prompt"]))
        except (ValueError, KeyError, TypeError) as e:
            raise UserError(f"{results_path}:{line_no}: not a result row ({e}); re-run the evaluation") from e
        cells[key] = _cell(folder, row, score_name, f"{results_path}:{line_no}")
    if not cells:
        raise UserError(f"{results_path} is empty; re-run the evaluation on at least one prompt")
    return metrics, cells


def _score_name(metrics: dict[str, Any]) -> str | None:
    """The label scores go under: the ``reward`` the evaluation recorded, ``None`` when it was run
    without one (``flowalign gallery --model`` with no ``--reward``), else ``"score"``."""
    if "reward" in metrics:
        return None if metrics["reward"] is None else str(metrics["reward"])
    return "score"


def _cell(folder: Path, row: dict[str, Any], score_name: str | None, where: str) -> GalleryCell:
    if not row.get("file"):
        raise UserError(f"{where}: no sample file recorded; re-run the evaluation with samples saved")
    media = folder / row["file"]
    if not media.is_file():
        raise UserError(f"{where}: sample {media} is missing; re-run the evaluation")
    poster = media.with_suffix(".poster.png")  # evaluate() writes one beside every video
    score = row.get("score")
    valid = row.get("valid", True) and isinstance(score, (int, float)) and math.isfinite(score)
    constraints = row.get("constraints")
    scores = {score_name: float(score)} if score_name is not None and valid else {}
    # a panel of rewards (evaluate --reward, eval.rewards) adds one score per reward; the summary table
    # then shows each reward's mean per column, e.g. per training step
    panel = row.get("scores") if isinstance(row.get("scores"), dict) else {}
    scores.update({str(k): float(v) for k, v in panel.items() if str(k) not in scores
                   and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)})
    return GalleryCell(
        media=media,
        poster=poster if media.suffix.lower() not in IMAGE_SUFFIXES and poster.is_file() else None,
        scores=scores,
        constraints=[(str(t), bool(p)) for t, p in constraints] if constraints is not None else None,
        all_passed=None if row.get("all_passed") is None else bool(row["all_passed"]),
        # the reward's reason, then the row's notes (a panel reward's failure causes, a unified model's
        # reflections): a reason does not hide what the sample itself recorded
        reason="; ".join(str(v) for v in [row.get("reason"), *_notes(row)] if v),
    )


def _notes(row: dict[str, Any]) -> list[Any]:
    """The values of a row's ``notes`` mapping (none when it has none, or it is not a mapping)."""
    notes = row.get("notes")
    return list(notes.values()) if isinstance(notes, dict) else []


# --------------------------------------------------------------------------------------------- writing


def write_gallery(out_dir: Path, columns: list[str], rows: list[GalleryRow], *, title: str,
                  overwrite: bool = False) -> Path:
    """Write ``index.html`` and ``media/`` into ``out_dir`` atomically (replacing an earlier gallery there,
    never other files; a non-empty folder without one needs ``overwrite``); returns its index.html."""
    out_dir = Path(out_dir)
    if not columns:
        raise UserError("a gallery needs at least one column (checkpoint or adapter)")
    if not rows:
        raise UserError("a gallery needs at least one prompt row; check the evaluations have results")
    for row in rows:
        if len(row.cells) != len(columns):
            raise UserError(f"prompt {row.prompt!r} has {len(row.cells)} cells for {len(columns)} columns; give one per column")
    with atomic_dir(out_dir, writer="gallery", overwrite=overwrite) as tmp:
        rendered = [[_place_media(tmp, c, r, cell) for c, cell in enumerate(row.cells)] for r, row in enumerate(rows)]
        with atomic_path(tmp / "index.html") as page:
            page.write_text(render_page(title, columns, rows, rendered), encoding="utf-8")
    return out_dir / "index.html"


def _place_media(root: Path, col: int, row: int, cell: GalleryCell | None) -> Placed | None:
    if cell is None:
        return None
    base = Path("media") / f"c{col:02d}" / f"{row:05d}"
    media = _link(cell.media, root / base.with_suffix(cell.media.suffix.lower()))
    if media.suffix != ".mp4":  # images and GIFs show as <img>: no poster, no fallback
        return Placed(_rel(media, root), None, None)
    poster = _link(cell.poster, root / base.with_suffix(".poster" + cell.poster.suffix.lower())) if cell.poster else None
    gif = _mp4_to_gif(media, media.with_suffix(".gif"))
    return Placed(_rel(media, root), poster and _rel(poster, root), _rel(gif, root))


def _link(src: Path, dest: Path) -> Path:
    """Hard-link ``src`` to ``dest`` (no extra disk for big videos), copying across file systems."""
    if not Path(src).is_file():
        raise UserError(f"gallery media {src} is missing; re-run the evaluation that wrote it")
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dest)
    except OSError:
        shutil.copyfile(src, dest)
    return dest


def _mp4_to_gif(mp4: Path, gif: Path) -> Path:
    """A looping GIF of the clip, for browsers built without H.264."""
    import imageio
    import imageio.v3 as iio
    import numpy as np

    with imageio.get_reader(mp4, format="FFMPEG") as reader:
        fps = float(reader.get_meta_data().get("fps") or 8)
        frames = np.stack(list(reader.iter_data()))
    iio.imwrite(gif, frames, extension=".gif", duration=1000 / fps, loop=0)
    return gif


def _rel(path: Path, root: Path) -> str:
    return quote(path.relative_to(root).as_posix())
