"""The ``flowalign`` command end to end on tiny models, and its one-line errors."""

import json

import numpy as np
import pytest
from PIL import Image

from flowalign.cli.main import main


def run(argv, capsys):
    code = main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_tiny_then_sample_png_is_deterministic(tmp_path, capsys):
    model = tmp_path / "tiny-sd3"
    assert run(["tiny", "sd3", "--out", str(model)], capsys)[0] == 0
    assert (model / "model_index.json").exists()
    a, b = tmp_path / "a.png", tmp_path / "b.png"
    for path in (a, b):
        code, out, _ = run(["sample", "--model", str(model), "--prompt", "a red circle", "--steps", "3",
                            "--sampler", "flow_grpo", "--seed", "4", "--out", str(path)], capsys)
        assert code == 0 and str(path) in out
    img = np.asarray(Image.open(a))
    assert img.shape == (32, 32, 3) and img.dtype == np.uint8
    assert np.array_equal(img, np.asarray(Image.open(b)))


def test_video_model_writes_mp4_and_refuses_png(tmp_path, capsys, tiny_wan_dir):
    clip = tmp_path / "clip.mp4"
    code, _, _ = run(["sample", "--model", str(tiny_wan_dir), "--prompt", "a ball", "--steps", "2", "--out", str(clip)], capsys)
    assert code == 0 and clip.stat().st_size > 0
    import imageio.v3 as iio

    frames = iio.imread(clip)
    assert frames.ndim == 4 and frames.shape[0] > 1
    code, _, err = run(["sample", "--model", str(tiny_wan_dir), "--prompt", "a ball", "--out", str(tmp_path / "x.png")], capsys)
    assert code == 2 and "video model" in err and ".mp4" in err


@pytest.mark.parametrize("argv,needle", [
    (["sample", "--model", "/nonexistent/model", "--prompt", "p", "--out", "x.png"], "does not exist"),
    (["sample", "--prompt", "p", "--sampler", "cps", "--noise-level", "1.5", "--out", "x.png"], "out of range"),
    (["sample", "--prompt", "p", "--out", "x.txt"], "unknown file type"),
    (["evaluate", "--bench", "no_such_bench", "--out", "o"], "unknown benchmark"),
    (["evaluate", "--level", "impossible", "--out", "o"], "unknown level"),
    (["evaluate", "--split", "train", "--out", "o"], "choose one of validation, test"),
    (["train", "/nonexistent.yaml"], "does not exist"),
])
def test_user_errors_are_one_line_without_traceback(argv, needle, capsys):
    code, _, err = run(argv, capsys)
    assert code == 2
    assert err.startswith("error: ") and needle in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_non_diffusers_folder(tmp_path, capsys):
    code, _, err = run(["sample", "--model", str(tmp_path), "--prompt", "p", "--out", str(tmp_path / "x.png")], capsys)
    assert code == 2 and "model_index.json" in err


def test_evaluate_writes_metrics_samples_and_verdicts(tmp_path, capsys, tiny_sd3_dir):
    out = tmp_path / "eval"
    code, stdout, _ = run(["evaluate", "--model", str(tiny_sd3_dir), "--bench", "vvr", "--level", "easy",
                           "--n", "3", "--seed", "5", "--steps", "2", "--out", str(out)], capsys)
    assert code == 0, stdout
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["n"] == 3 and 0 <= metrics["accuracy"] <= 1 and 0 <= metrics["mean_score"] <= 1
    assert metrics["per_constraint"] and all(0 <= v <= 1 for v in metrics["per_constraint"].values())
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and all((out / r["file"]).exists() and "constraints" in r for r in rows)


def test_evaluate_split_picks_the_shipped_file_and_is_recorded(tmp_path, capsys, tiny_sd3_dir):
    from rewards.vvr import is_heldout, load_split

    prompts = {}
    for split in ("validation", "test"):
        out = tmp_path / split
        code, stdout, _ = run(["evaluate", "--model", str(tiny_sd3_dir), "--level", "easy", "--split", split,
                               "--n", "2", "--steps", "2", "--out", str(out)], capsys)
        assert code == 0, stdout
        assert json.loads((out / "metrics.json").read_text())["split"] == split
        prompts[split] = [json.loads(line)["prompt"] for line in (out / "results.jsonl").read_text().splitlines()]
        assert prompts[split] == [t.prompt for t in load_split("easy", split, 2)]
    assert not set(prompts["validation"]) & set(prompts["test"])
    assert all(is_heldout(t.constraints) for t in load_split("easy", "test", 2))
    code, _, _ = run(["evaluate", "--model", str(tiny_sd3_dir), "--level", "easy", "--n", "1", "--steps", "2",
                      "--out", str(tmp_path / "default")], capsys)
    assert code == 0 and json.loads((tmp_path / "default" / "metrics.json").read_text())["split"] == "test"
