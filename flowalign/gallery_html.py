"""The HTML page of a gallery (:mod:`flowalign.gallery`): summary table, one row per prompt, inline CSS and JS.

Everything shown is escaped (prompts are user input); numbers also sit in ``data-*`` attributes so that
scripts and tests read them exactly.
"""

from __future__ import annotations

import html

from flowalign.gallery_cells import GalleryCell, GalleryRow, Placed


def _e(value: object) -> str:
    """HTML-escape any text or attribute value (prompts are user input and may contain markup)."""
    return html.escape(str(value), quote=True)


def _fmt(value: float | None, signed: bool = False) -> str:
    return "—" if value is None else f"{value:+.3f}" if signed else f"{value:.3f}"


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def render_page(title: str, columns: list[str], rows: list[GalleryRow], placed: list[list[Placed | None]]) -> str:
    """The whole ``index.html``: ``placed[r][c]`` is where row ``r``'s cell ``c`` landed (None: not evaluated)."""
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


def _row(index: int, row: GalleryRow, columns: list[str], placed: list[Placed | None], score_names: list[str],
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


def _cell_html(label: str, cell: GalleryCell | None, where: Placed | None, score_names: list[str]) -> str:
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


def _media_html(label: str, where: Placed) -> str:
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
