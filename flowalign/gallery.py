"""Static HTML evaluation galleries: one row per prompt, one column per checkpoint or adapter.

A gallery is a self-contained folder (``index.html`` + ``media/``) that works opened from disk or
served from anywhere: media are hard-linked (copied across file systems) under ``media/`` and
referenced by relative path. Each cell shows the sample, its scores and, for VVR-style rewards, the
per-constraint verdicts; a summary table (mean score, accuracy per column) sits on top, and the rows
sort by reward gain (last column minus first) or by prompt with a few lines of inline JS.
"""

from __future__ import annotations

import html
import json
import math
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

from flowalign.errors import UserError
from flowalign.io import atomic_dir, atomic_path
from flowalign.media import IMAGE_SUFFIXES

# the folder name trainers give the evaluation at a step: runs/NAME/evals/step-000100/
STEP_DIR = re.compile(r"step-(\d{6})")


@dataclass
class GalleryCell:
    """One sample: its media file (image, MP4 or GIF), scores and, when judged, the verdicts."""

    media: Path
    poster: Path | None = None
    scores: dict[str, float] = field(default_factory=dict)
    constraints: list[tuple[str, bool]] | None = None
    all_passed: bool | None = None
    reason: str = ""

    @property
    def score(self) -> float | None:
        """The first score: the one gains, sorting and the summary's Δ use."""
        return next(iter(self.scores.values()), None)


@dataclass
class GalleryRow:
    """One prompt, sampled with the same ``seed`` in every column (``None`` where a column is missing)."""

    prompt: str
    cells: list[GalleryCell | None]
    seed: int | None = None

    @property
    def gain(self) -> float | None:
        """Last column's score minus the first's; ``None`` when either is missing or unscored."""
        first, last = self.cells[0], self.cells[-1]
        if first is None or last is None or first.score is None or last.score is None:
            return None
        return last.score - first.score


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
    return GalleryCell(
        media=media,
        poster=poster if media.suffix.lower() not in IMAGE_SUFFIXES and poster.is_file() else None,
        scores={score_name: float(score)} if score_name is not None and valid else {},
        constraints=[(str(t), bool(p)) for t, p in constraints] if constraints is not None else None,
        all_passed=None if row.get("all_passed") is None else bool(row["all_passed"]),
        reason=str(row.get("reason") or ""),
    )


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
            page.write_text(_page(title, columns, rows, rendered), encoding="utf-8")
    return out_dir / "index.html"


@dataclass
class _Placed:
    """Where a cell's files landed in the gallery, as paths relative to index.html."""

    media: str
    poster: str | None
    gif: str | None  # the GIF fallback of an MP4


def _place_media(root: Path, col: int, row: int, cell: GalleryCell | None) -> _Placed | None:
    if cell is None:
        return None
    base = Path("media") / f"c{col:02d}" / f"{row:05d}"
    media = _link(cell.media, root / base.with_suffix(cell.media.suffix.lower()))
    if media.suffix != ".mp4":  # images and GIFs show as <img>: no poster, no fallback
        return _Placed(_rel(media, root), None, None)
    poster = _link(cell.poster, root / base.with_suffix(".poster" + cell.poster.suffix.lower())) if cell.poster else None
    gif = _mp4_to_gif(media, media.with_suffix(".gif"))
    return _Placed(_rel(media, root), poster and _rel(poster, root), _rel(gif, root))


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


# ------------------------------------------------------------------------------------------------ HTML


def _e(value: object) -> str:
    """HTML-escape any text or attribute value (prompts are user input and may contain markup)."""
    return html.escape(str(value), quote=True)


def _fmt(value: float | None, signed: bool = False) -> str:
    return "—" if value is None else f"{value:+.3f}" if signed else f"{value:.3f}"


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _page(title: str, columns: list[str], rows: list[GalleryRow], placed: list[list[_Placed | None]]) -> str:
    # default order: gain descending, rows without a gain last (also the order without JS)
    order = sorted(range(len(rows)), key=lambda i: (rows[i].gain is None, -(rows[i].gain or 0.0), i))
    score_names = list(dict.fromkeys(k for row in rows for cell in row.cells if cell for k in cell.scores))
    # gains (and their sort orders, badges and Δ column) only mean something with scores and 2+ columns
    compare = bool(score_names) and len(columns) > 1
    body = "\n".join(_row(i, rows[i], columns, placed[i], score_names, compare) for i in order)
    sorts = [("index", "prompt order"), ("prompt", "prompt, A → Z")]
    if compare:
        sorts = [("gain-desc", "reward gain, high → low"), ("gain-asc", "reward gain, low → high"), *sorts[::-1]]
    options = "".join(f'<option value="{value}">{text}</option>' for value, text in sorts)
    hint = f'<span class="hint">gain = {_e(columns[-1])} − {_e(columns[0])}</span>' if compare else ""
    return f"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{_e(title)}</title>
<style>{_CSS}</style>
</head>
<body>
<header>
<h1>{_e(title)}</h1>
<p class="sub">{len(rows)} prompt{'s' * (len(rows) != 1)} × {len(columns)} column{'s' * (len(columns) != 1)}</p>
</header>
<main>
{_summary(columns, rows, score_names, compare)}
<div class="controls"><label for="sort">Sort</label>
<select id="sort">{options}</select>
{hint}</div>
<div id="rows">
{body}
</div>
</main>
<script>{_JS}</script>
</body>
</html>
"""


def _summary(columns: list[str], rows: list[GalleryRow], score_names: list[str], compare: bool) -> str:
    """Per column: samples, mean of each score, Δ of the first score vs the first column, accuracy."""
    present = [[row.cells[c] for row in rows if row.cells[c] is not None] for c in range(len(columns))]
    means = [[_mean([cell.scores[k] for cell in cells if k in cell.scores]) for k in score_names] for cells in present]
    base = means[0][0] if score_names else None
    judges = any(cell.all_passed is not None for cells in present for cell in cells)  # else no accuracy column
    lines = []
    for c, (label, cells, col_means) in enumerate(zip(columns, present, means)):
        primary = col_means[0] if score_names else None
        delta = None if c == 0 or base is None or primary is None else primary - base
        judged = [cell.all_passed for cell in cells if cell.all_passed is not None]
        accuracy = _mean([float(p) for p in judged])
        acc = "—" if accuracy is None else f"{accuracy:.1%} <small>({sum(judged)}/{len(judged)})</small>"
        tds = "".join(_num_td(k, m, _fmt(m)) for k, m in zip(score_names, col_means))
        lines.append(f'<tr data-column="{_e(label)}"><th scope="row">{_e(label)}</th><td class="num">{len(cells)}</td>'
                     f'{tds}{_num_td("delta", delta, _fmt(delta, signed=True)) if compare else ""}'
                     f'{_num_td("accuracy", accuracy, acc) if judges else ""}</tr>')
    head = "".join(f"<th>{_e(name)}</th>" for name in score_names) + (f"<th>Δ vs {_e(columns[0])}</th>" if compare else "")
    head += "<th>accuracy</th>" if judges else ""
    return (f'<table class="summary"><thead><tr><th>column</th><th>samples</th>{head}</tr></thead><tbody>\n'
            + "\n".join(lines) + "\n</tbody></table>")


def _num_td(metric: str, value: float | None, text: str) -> str:
    """A numeric summary cell; ``data-value`` keeps the exact number for scripts and tests."""
    return f'<td class="num" data-metric="{_e(metric)}" data-value="{"" if value is None else repr(value)}">{text}</td>'


def _row(index: int, row: GalleryRow, columns: list[str], placed: list[_Placed | None], score_names: list[str],
         compare: bool) -> str:
    gain = row.gain
    gain_cls = "" if gain is None else " up" if gain > 0 else " down" if gain < 0 else ""
    badge = f'<span class="badge gain{gain_cls}">gain {_fmt(gain, signed=True)}</span>' if compare else ""
    seed = "" if row.seed is None else f'<span class="badge seed">seed {row.seed}</span>'
    cells = "\n".join(_cell_html(label, cell, where, score_names) for label, cell, where in zip(columns, row.cells, placed))
    data_gain = "" if gain is None else repr(gain)
    return f"""<article class="row" data-index="{index}" data-prompt="{_e(row.prompt)}" data-gain="{data_gain}">
<div class="row-head"><p class="prompt">{_e(row.prompt)}</p>{seed}{badge}</div>
<div class="cells" style="--cols:{len(columns)}">
{cells}
</div>
</article>"""


def _cell_html(label: str, cell: GalleryCell | None, where: _Placed | None, score_names: list[str]) -> str:
    if cell is None or where is None:
        return f'<figure class="cell missing"><figcaption>{_e(label)}</figcaption><div class="empty">not evaluated</div></figure>'
    # every score the gallery shows, "—" where this sample has none (invalid), so cells line up
    scores = "".join(f"<dt>{_e(k)}</dt><dd>{_fmt(cell.scores.get(k))}</dd>" for k in score_names)
    verdict = ("" if cell.all_passed is None else
               f'<span class="badge {"pass" if cell.all_passed else "fail"}">{"PASS" if cell.all_passed else "FAIL"}</span>')
    checks = "".join(f'<li class="{"pass" if ok else "fail"}">{"✓" if ok else "✗"} {_e(name)}</li>'
                     for name, ok in cell.constraints or [])
    return (f'<figure class="cell"><figcaption>{_e(label)}{verdict}</figcaption>{_media_html(label, where)}'
            + (f'<dl class="scores">{scores}</dl>' if scores else "")
            + (f'<ul class="checks">{checks}</ul>' if checks else "")
            + (f'<p class="reason" title="{_e(cell.reason)}">{_e(cell.reason)}</p>' if cell.reason else "")
            + "</figure>")


def _media_html(label: str, where: _Placed) -> str:
    alt = _e(f"{label} sample")
    if where.gif is None:  # an image, or a clip that is already a GIF
        return f'<img src="{where.media}" alt="{alt}" decoding="async">'
    poster = f' poster="{where.poster}"' if where.poster else ""
    # the <img> inside <video> only shows where <video> is unsupported; the script swaps it in when
    # this browser cannot decode H.264 (Chromium builds without proprietary codecs)
    return (f'<video controls loop muted playsinline preload="metadata"{poster} data-gif="{where.gif}">'
            f'<source src="{where.media}" type="video/mp4"><img src="{where.gif}" alt="{alt}"></video>')


_CSS = """
:root { --bg:#f5f6f8; --card:#fff; --ink:#1d2330; --muted:#667085; --line:#e3e6eb;
        --pass:#16794a; --pass-bg:#e3f5eb; --fail:#b42318; --fail-bg:#fdeceb; --accent:#3553c7; }
* { box-sizing: border-box; }
body { margin:0; background:var(--bg); color:var(--ink);
       font:14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, "DejaVu Sans", sans-serif; }
header { background:#1d2330; color:#fff; padding:18px 28px; }
header h1 { margin:0; font-size:22px; font-weight:600; }
header .sub { margin:4px 0 0; color:#c4cad6; }
main { padding:20px 28px 40px; max-width:1600px; }
table.summary { border-collapse:collapse; background:var(--card); border:1px solid var(--line);
                border-radius:8px; overflow:hidden; margin-bottom:16px; }
.summary th, .summary td { padding:7px 14px; border-bottom:1px solid var(--line); text-align:left; }
.summary thead th { background:#eef0f4; font-weight:600; color:var(--muted); font-size:12px;
                    text-transform:uppercase; letter-spacing:.03em; }
.summary tbody tr:last-child > * { border-bottom:none; }
.summary td.num { text-align:right; font-variant-numeric:tabular-nums; }
.summary small { color:var(--muted); }
.controls { display:flex; align-items:center; gap:10px; margin:0 0 14px; }
.controls label { font-weight:600; }
.controls select { font:inherit; padding:4px 8px; border:1px solid var(--line); border-radius:6px; background:#fff; }
.controls .hint { color:var(--muted); }
.row { background:var(--card); border:1px solid var(--line); border-radius:10px; padding:12px 14px; margin-bottom:14px; }
.row-head { display:flex; align-items:baseline; gap:8px; margin-bottom:10px; }
.prompt { margin:0; flex:1; font-weight:600; overflow-wrap:anywhere; }
.badge { display:inline-block; padding:1px 8px; border-radius:999px; font-size:12px; font-weight:600;
         background:#eef0f4; color:var(--muted); white-space:nowrap; }
.badge.gain.up { background:var(--pass-bg); color:var(--pass); }
.badge.gain.down { background:var(--fail-bg); color:var(--fail); }
.badge.pass { background:var(--pass-bg); color:var(--pass); }
.badge.fail { background:var(--fail-bg); color:var(--fail); }
.cells { display:grid; grid-template-columns:repeat(var(--cols), minmax(150px, 240px)); gap:12px; overflow-x:auto; }
.cell { margin:0; min-width:0; }
.cell figcaption { display:flex; justify-content:space-between; align-items:center; min-height:20px; color:var(--muted);
                   font-size:12px; font-weight:600; margin-bottom:4px; }
.cell img, .cell video { display:block; width:100%; aspect-ratio:1; object-fit:contain; background:#0f1115;
                         border-radius:6px; }
.cell.missing .empty { aspect-ratio:1; display:grid; place-items:center; color:var(--muted);
                       border:1px dashed var(--line); border-radius:6px; }
.scores { display:grid; grid-template-columns:auto 1fr; gap:0 8px; margin:6px 0 0; font-size:13px; }
.scores dt { color:var(--muted); }
.scores dd { margin:0; text-align:right; font-variant-numeric:tabular-nums; font-weight:600; }
.checks { list-style:none; margin:6px 0 0; padding:0; display:flex; flex-wrap:wrap; gap:4px; font-size:12px; }
.checks li { padding:0 6px; border-radius:4px; }
.checks .pass { color:var(--pass); background:var(--pass-bg); }
.checks .fail { color:var(--fail); background:var(--fail-bg); }
.reason { margin:6px 0 0; color:var(--muted); font-size:12px; display:-webkit-box; -webkit-line-clamp:3;
          -webkit-box-orient:vertical; overflow:hidden; }
"""

# Sorting (the select, or a shareable #sort=MODE in the address) and two facts tests and people can
# read off the DOM: how many images decoded, and whether each video plays as MP4 or fell back to GIF.
_JS = """
(() => {
  const rows = document.getElementById("rows"), select = document.getElementById("sort");
  const idx = r => Number(r.dataset.index);
  const gain = r => r.dataset.gain === "" ? null : Number(r.dataset.gain);
  const byGain = sign => (a, b) => {
    const x = gain(a), y = gain(b);
    if (x === null || y === null) return (x === null) - (y === null) || idx(a) - idx(b);
    return sign * (x - y) || idx(a) - idx(b);
  };
  const orders = {
    "gain-desc": byGain(-1), "gain-asc": byGain(1), "index": (a, b) => idx(a) - idx(b),
    "prompt": (a, b) => a.dataset.prompt.localeCompare(b.dataset.prompt) || idx(a) - idx(b),
  };
  const sortRows = mode => {
    if (![...select.options].some(o => o.value === mode)) mode = select.options[0].value;
    [...rows.children].sort(orders[mode]).forEach(r => rows.appendChild(r));
    select.value = mode;
    document.body.dataset.sort = mode;
  };
  select.addEventListener("change", () => { sortRows(select.value); history.replaceState(null, "", "#sort=" + select.value); });
  sortRows(new URLSearchParams(location.hash.slice(1)).get("sort"));

  const videos = [...document.querySelectorAll("video[data-gif]")];
  const record = () => { document.body.dataset.videoPlayback = videos.map(v => v.dataset.playback || "pending").join(","); };
  const toGif = v => {
    if (v.dataset.playback === "gif") return;
    const img = v.querySelector("img");
    v.dataset.playback = "gif";
    v.replaceWith(img);
    record();
  };
  for (const v of videos) {
    if (v.canPlayType('video/mp4; codecs="avc1.640028"') === "") { toGif(v); continue; }
    v.dataset.playback = "mp4";
    // a file this build cannot decode after all: the source or the element reports an error
    v.querySelector("source").addEventListener("error", () => toGif(v));
    v.addEventListener("error", () => toGif(v));
  }
  record();
  window.addEventListener("load", () => {
    const imgs = [...document.images];
    document.body.dataset.imagesTotal = imgs.length;
    document.body.dataset.imagesLoaded = imgs.filter(i => i.complete && i.naturalWidth > 0).length;
  });
})();
"""
