"""Evaluation galleries: loaders, the written HTML (escaping, relative media, sort data, summary
numbers), the ``flowalign gallery`` CLI, and the page as headless Chromium runs it."""

from __future__ import annotations

import json
import math
import shutil
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch
from PIL import Image

from flowalign.cli.main import main
from flowalign.errors import UserError
from flowalign.gallery import GalleryCell, GalleryRow, gallery_from_evals, gallery_from_run, write_gallery
from flowalign.media import save_video
from flowalign.paths import REPO_ROOT
from tests.flowalign.browser import render_in_chromium
from tests.flowalign.sampling.gaussian_policy import GaussianPolicy

XSS = "<script>alert(1)</script>"
PROMPTS = ["a red cube & a blue sphere", XSS, "a video of waves", "zebra on a beach"]
SEED = 7
# score per (step, prompt index); None: prompt not evaluated at that step; NaN: invalid sample
SCORES = {
    0: [0.2, 0.5, 0.1, 0.4],
    100: [0.4, math.nan, 0.3, None],
    200: [0.9, 0.3, 0.2, 0.6],
}
# VVR verdicts for the image prompts 0 and 3 (all_passed per step)
PASSED = {0: {0: False, 3: True}, 100: {0: True}, 200: {0: True, 3: True}}
GAIN_ORDER = [0, 3, 2, 1]  # gains 0.7, 0.2, 0.1, -0.2
N_IMAGES = 8 + 3  # PNG cells, plus one GIF fallback per video
CHROMIUM = pytest.mark.requires_program("chromium", install="apt-get install -y chromium")


class Tags(HTMLParser):
    """Every start tag with its (unescaped) attributes, and the page's text, in document order."""

    def __init__(self, page: str):
        super().__init__()
        self.tags: list[tuple[str, dict[str, str]]] = []
        self.text: list[str] = []
        self.feed(page)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, {k: v or "" for k, v in attrs}))

    def handle_data(self, data: str) -> None:
        self.text.append(data)

    def all(self, tag: str, **attrs: str) -> list[dict[str, str]]:
        return [a for t, a in self.tags if t == tag and all(a.get(k.replace("_", "-")) == v for k, v in attrs.items())]


def _png(path: Path, value: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (32, 32), (value, 80, 255 - value)).save(path)


@pytest.fixture(scope="module")
def mp4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    frames = torch.linspace(0, 1, 6).view(6, 1, 1, 1).expand(6, 3, 16, 16)
    path = save_video(frames, tmp_path_factory.mktemp("clip") / "clip.mp4")
    assert path.suffix == ".mp4", "imageio-ffmpeg could not write MP4"
    return path


def _write_eval(folder: Path, step: int, mp4: Path) -> None:
    """What evaluate(..., out_dir=folder) writes, by hand."""
    rows = []
    (folder / "samples").mkdir(parents=True)
    for i, prompt in enumerate(PROMPTS):
        score = SCORES[step][i]
        if score is None:
            continue
        row = {"index": i, "prompt": prompt, "valid": not math.isnan(score), "score": score}
        if i == 2:
            shutil.copyfile(mp4, folder / "samples" / f"{i:05d}.mp4")
            _png(folder / "samples" / f"{i:05d}.poster.png", 10)
            row["file"] = f"samples/{i:05d}.mp4"
        else:
            _png(folder / "samples" / f"{i:05d}.png", 0 if math.isnan(score) else int(score * 250))
            row["file"] = f"samples/{i:05d}.png"
        if i in PASSED[step]:
            row.update(constraints=[["count", True], ["color", PASSED[step][i]]], all_passed=PASSED[step][i],
                       reason="" if PASSED[step][i] else "the cube is <b>green</b>")
        rows.append(row)
    (folder / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "metrics.json").write_text(json.dumps({"seed": SEED, "n": len(rows)}))


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory, mp4: Path) -> Path:
    run = tmp_path_factory.mktemp("runs") / "demo"
    for step in SCORES:
        _write_eval(run / "evals" / f"step-{step:06d}", step, mp4)
    (run / "evals" / "step-000300").mkdir()  # an evaluation still being written: skipped
    return run


@pytest.fixture(scope="module")
def gallery(run_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    # not RUN/gallery, which the CLI test rewrites
    columns, rows = gallery_from_run(run_dir)
    return write_gallery(tmp_path_factory.mktemp("gallery") / "gallery", columns, rows, title="demo <run> & co")


def test_run_loader_orders_steps_and_matches_rows(run_dir: Path) -> None:
    columns, rows = gallery_from_run(run_dir)
    assert columns == ["step 0", "step 100", "step 200"]
    assert [r.prompt for r in rows] == PROMPTS
    assert [r.seed for r in rows] == [SEED + i for i in range(4)]
    assert rows[3].cells[1] is None  # not evaluated at step 100
    assert rows[1].cells[1].scores == {}  # invalid sample: no score
    assert rows[0].cells[0].constraints == [("count", True), ("color", False)]
    assert rows[2].cells[0].poster.name == "00002.poster.png"
    assert [r.gain for r in rows] == pytest.approx([0.7, -0.2, 0.1, 0.2])


def test_a_cell_shows_the_rewards_reason_and_the_samples_notes(tmp_path: Path) -> None:
    """A reward's reason does not hide the row's own notes (e.g. what a unified model wrote each round)."""
    _png(tmp_path / "samples" / "00000.png", 10)
    rows = [{"index": i, "prompt": f"p{i}", "score": 0.5, "file": "samples/00000.png", **extra} for i, extra in
            enumerate([{"reason": "the cube is green", "notes": {"reflections": "1: make it red"}},
                       {"notes": {"reflections": "1: no change"}}, {"reason": "two cubes"}, {"reason": "", "notes": {}},
                       {"notes": {"a": "first", "b": "", "c": "third"}}])]
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "metrics.json").write_text(json.dumps({"seed": 0}))
    _, loaded = gallery_from_evals([tmp_path], ["run"])
    assert [r.cells[0].reason for r in loaded] == ["the cube is green; 1: make it red", "1: no change", "two cubes", "",
                                                 "first; third"]


def test_html_escapes_text(gallery: Path) -> None:
    page = gallery.read_text()
    assert XSS not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert page.count("<script") == 1  # only the page's own
    assert "a red cube &amp; a blue sphere" in page and "<title>demo &lt;run&gt; &amp; co</title>" in page
    assert "<b>green</b>" not in page and "&lt;b&gt;green&lt;/b&gt;" in page


def test_media_are_relative_and_inside_the_gallery(gallery: Path) -> None:
    tags = Tags(gallery.read_text())
    refs = [a["src"] for t, a in tags.tags if "src" in a] + [a["poster"] for t, a in tags.tags if "poster" in a]
    assert len(tags.all("img")) == N_IMAGES and refs
    for ref in refs:
        assert not ref.startswith(("/", "file:", "http")) and ".." not in ref
        assert (gallery.parent / ref).is_file(), ref
    videos = tags.all("video")
    assert len(videos) == 3 and all({"controls", "loop", "muted", "playsinline"} <= set(v) for v in videos)
    assert len(tags.all("source", type="video/mp4")) == 3
    for video in videos:
        assert video["poster"].endswith(".poster.png") and video["data-gif"].endswith(".gif")


def test_rows_carry_sort_data_in_gain_order(gallery: Path) -> None:
    rows = Tags(gallery.read_text()).all("article")
    assert [int(r["data-index"]) for r in rows] == GAIN_ORDER
    assert [r["data-prompt"] for r in rows] == [PROMPTS[i] for i in GAIN_ORDER]
    assert [float(r["data-gain"]) for r in rows] == pytest.approx([0.7, 0.2, 0.1, -0.2])


def test_summary_numbers(gallery: Path) -> None:
    tags = Tags(gallery.read_text())
    values = {m: [a["data-value"] for a in tags.all("td", data_metric=m)] for m in ("score", "delta", "accuracy")}
    assert [float(v) for v in values["score"]] == pytest.approx([0.3, 0.35, 0.5])  # invalid and missing skipped
    assert values["delta"][0] == "" and [float(v) for v in values["delta"][1:]] == pytest.approx([0.05, 0.2])
    assert [float(v) for v in values["accuracy"]] == pytest.approx([0.5, 1.0, 1.0])
    assert "✓ count" in "".join(tags.text) and "✗ color" in "".join(tags.text)


def test_cells_must_match_columns(tmp_path: Path) -> None:
    _png(tmp_path / "a.png", 1)
    with pytest.raises(UserError, match="one per column"):
        write_gallery(tmp_path / "g", ["a", "b"], [GalleryRow("p", [GalleryCell(tmp_path / "a.png")])], title="t")


def test_bad_input_is_a_user_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["gallery", "--evals", str(tmp_path / "nope"), "--out", str(tmp_path / "g")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "no such evaluation folder" in err and err.count("\n") == 1
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "results.jsonl").write_text("")
    with pytest.raises(UserError, match="is empty"):
        gallery_from_evals([tmp_path / "empty"], ["x"])
    (tmp_path / "run" / "evals").mkdir(parents=True)
    with pytest.raises(UserError, match="no finished evaluations"):
        gallery_from_run(tmp_path / "run")


def test_cli_run_writes_into_the_run(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["gallery", "--run", str(run_dir)]) == 0
    assert capsys.readouterr().out.strip() == str(run_dir / "gallery" / "index.html")


def test_cli_evals_with_labels(run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    evals = [str(run_dir / "evals" / s) for s in ("step-000000", "step-000200")]
    assert main(["gallery", "--evals", *evals, "--labels", "base", "tuned", "--out", str(tmp_path / "g")]) == 0
    index = Path(capsys.readouterr().out.strip())
    assert index == tmp_path / "g" / "index.html"
    assert [a["data-column"] for a in Tags(index.read_text()).all("tr") if "data-column" in a] == ["base", "tuned"]


class ImagePolicy(GaussianPolicy):
    """The exact Gaussian flow over 3×8×8 'images'; an adapter shifts its mean."""

    def __init__(self, mean: float):
        super().__init__(mean=mean, std=0.2, dim=3 * 8 * 8)

    def decode(self, x0: torch.Tensor) -> torch.Tensor:
        return x0.view(-1, 3, 8, 8).clamp(0, 1)


def brightness(samples: torch.Tensor, prompts: list[str], metadata: list[dict]) -> torch.Tensor:
    """A reward for the CLI test, loaded by ``module:attr``."""
    return samples.mean(dim=(1, 2, 3))


def test_cli_samples_model_and_adapters(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    import flowalign.cli.gallery as cli
    import flowalign.evaluation

    monkeypatch.setattr(cli, "load_policy", lambda args: ImagePolicy(0.7 if args.adapter else 0.3))
    seen: list[list[dict]] = []
    real_evaluate = flowalign.evaluation.evaluate

    def evaluate(policy, prompts, metadata, *args, **kwargs):  # records the metadata each column got
        seen.append(metadata)
        return real_evaluate(policy, prompts, metadata, *args, **kwargs)

    monkeypatch.setattr(flowalign.evaluation, "evaluate", evaluate)  # what the command imports when it runs
    task = {"objects": [{"shape": "cube", "color": "red"}]}
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(f"a plain prompt\n\n{json.dumps({'prompt': 'a red cube', 'task': task})}\n")
    argv = ["gallery", "--model", str(tmp_path), "--adapter", str(tmp_path / "ckpt" / "step-000100"),
            "--prompts", str(prompts), "--steps", "2"]
    assert main([*argv, "--reward", "tests.flowalign.test_gallery:brightness", "--out", str(tmp_path / "g")]) == 0
    index = Path(capsys.readouterr().out.strip())
    assert seen[0] == [{}, {"task": task}]
    tags = Tags(index.read_text())
    assert [a["data-column"] for a in tags.all("tr") if "data-column" in a] == ["base", "step-000100"]
    assert [float(a["data-gain"]) > 0.2 for a in tags.all("article")] == [True, True]  # brighter adapter
    assert [a["data-prompt"] for a in tags.all("article") if a["data-index"] == "1"] == ["a red cube"]
    assert not any(p.name.startswith(".g.evals-") for p in tmp_path.iterdir())  # temporary evaluations gone

    # without --reward: images only, no scores or gains anywhere
    assert main([*argv, "--out", str(tmp_path / "images")]) == 0
    tags = Tags(Path(capsys.readouterr().out.strip()).read_text())
    assert not tags.all("dl") and not [a for a in tags.all("td") if "data-metric" in a]  # no score, Δ or accuracy
    assert [a["data-gain"] for a in tags.all("article")] == ["", ""]
    assert [a["value"] for a in tags.all("option")] == ["index", "prompt"]


@CHROMIUM
def test_page_in_headless_chromium(gallery: Path) -> None:
    screenshot = REPO_ROOT / "test-artifacts" / "gallery.png"
    body = Tags(render_in_chromium(gallery, screenshot)).all("body")[0]
    assert body["data-sort"] == "gain-desc"
    assert body["data-images-total"] == str(N_IMAGES)
    assert body["data-images-loaded"] == str(N_IMAGES)  # every image decoded: paths work from disk
    playback = body["data-video-playback"].split(",")
    assert len(playback) == 3 and set(playback) <= {"mp4", "gif"}, playback
    with Image.open(screenshot) as shot:
        assert shot.size == (1280, 900)

    dom = Tags(render_in_chromium(gallery, None, fragment="sort=prompt"))
    assert [a["data-prompt"] for a in dom.all("article")] == sorted(PROMPTS)
    videos = dom.all("video")
    if playback == ["mp4"] * 3:
        assert len(videos) == 3 and len(dom.all("source", type="video/mp4")) == 3
    else:  # no H.264 in this build: the GIF took the video's place
        assert len(videos) == playback.count("mp4")
        assert len([a for a in dom.all("img") if a["src"].endswith(".gif")]) == 3


@CHROMIUM
def test_gif_fallback_without_h264(gallery: Path, tmp_path: Path) -> None:
    # Chromium builds without proprietary codecs answer "" here; make this one answer the same
    copy = shutil.copytree(gallery.parent, tmp_path / "gallery")
    page = (copy / "index.html").read_text()
    assert page.count('video/mp4; codecs="avc1.640028"') == 1
    (copy / "index.html").write_text(page.replace('video/mp4; codecs="avc1.640028"', "video/x-unplayable"))
    dom = Tags(render_in_chromium(copy / "index.html", None))
    body = dom.all("body")[0]
    assert body["data-video-playback"] == "gif,gif,gif" and not dom.all("video")
    assert len([a for a in dom.all("img") if a["src"].endswith(".gif")]) == 3
    assert body["data-images-loaded"] == body["data-images-total"] == str(N_IMAGES)
