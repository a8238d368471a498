"""``flowalign evaluate --prompts FILE --reward SPEC ...``: any prompt set scored by any rewards, with
per-reward 95% intervals, per-sample scores, per-tag accuracy and a gallery of the result."""

import json

import pytest

from flowalign.cli.main import main
from flowalign.eval_panel import mean_ci
from flowalign.gallery import gallery_from_evals


def test_prompt_file_scored_by_two_rewards(tmp_path, capsys, tiny_sd3_dir):
    prompts = tmp_path / "metadata.jsonl"
    tags = ["single_object", "counting", "counting"]
    prompts.write_text("".join(json.dumps({"tag": t, "include": [], "prompt": f"prompt {i}"}) + "\n"
                               for i, t in enumerate(tags)))
    out = tmp_path / "eval"
    code = main(["evaluate", "--model", str(tiny_sd3_dir), "--prompts", str(prompts), "--reward", "brightness",
                 "--reward", "{name: jpeg_compressibility, quality: 80}", "--steps", "2", "--out", str(out)])
    assert code == 0, capsys.readouterr().err
    metrics = json.loads((out / "metrics.json").read_text())
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert metrics["rewards"] == ["brightness", "jpeg_compressibility"] and metrics["n"] == 3
    for name in metrics["rewards"]:
        values = [r["scores"][name] for r in rows]
        mean, low, high = mean_ci(values)
        assert metrics[name] == pytest.approx(mean) and metrics[f"{name}/valid_fraction"] == 1.0
        assert (metrics[f"{name}/ci95_low"], metrics[f"{name}/ci95_high"]) == pytest.approx((low, high))
        assert low < mean < high
    # the first reward is each row's score; tags give GenEval's per-tag accuracy and its mean over tags
    assert [r["score"] for r in rows] == [r["scores"]["brightness"] for r in rows]
    counting = (rows[1]["score"] + rows[2]["score"]) / 2
    assert metrics["accuracy/counting"] == pytest.approx(counting)
    assert metrics["accuracy/single_object"] == pytest.approx(rows[0]["score"])
    assert metrics["accuracy/overall"] == pytest.approx((counting + rows[0]["score"]) / 2)
    # the gallery shows every reward of the panel
    _, gallery_rows = gallery_from_evals([out], ["tiny"])
    assert set(gallery_rows[0].cells[0].scores) == {"brightness", "jpeg_compressibility"}


@pytest.mark.parametrize("argv, needle", [
    (["--prompts", "p.txt"], "needs at least one --reward"),
    (["--prompts", "p.txt", "--bench", "vvr", "--reward", "brightness"], "not both"),
    (["--bench", "vvr", "--reward", "{name: brightness"], "not valid YAML"),
    (["--bench", "vvr", "--reward", "brightness", "--reward", "brightness"], "given twice"),
])
def test_bad_reward_options_are_one_line(argv, needle, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "p.txt").write_text("a cat\n")
    assert main(["evaluate", *argv, "--out", "o"]) == 2
    err = capsys.readouterr().err
    assert needle in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("argv, needle", [
    (["--bench", "geneval", "--reward-option", "path"], "is not KEY=VALUE"),
    (["--bench", "vvr", "--reward-option", "path=/weights"], "benchmark 'vvr' takes no reward options"),
    (["--prompts", "p.txt", "--reward", "brightness", "--reward-option", "path=/w"], "give each reward's options"),
])
def test_bad_benchmark_reward_options_are_one_line(argv, needle, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "p.txt").write_text("a cat\n")
    assert main(["evaluate", *argv, "--out", "o"]) == 2
    err = capsys.readouterr().err
    assert needle in err and len(err.strip().splitlines()) == 1


def test_help_and_guide_list_every_registered_benchmark(capsys):
    """The ``--bench`` help is built from the registry; the guide's benchmark table names each one."""
    from flowalign.benchmarks import available_benchmarks
    from flowalign.paths import REPO_ROOT

    with pytest.raises(SystemExit):
        main(["evaluate", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    guide = (REPO_ROOT / "docs" / "guide" / "evaluation.md").read_text()
    assert {"vvr", "vvr_motion", "vvr_edit", "geneval", "ocr"} <= set(available_benchmarks())
    for name in available_benchmarks():
        assert name in help_text.split("benchmark name (default vvr):")[1].split("--")[0]
        assert f"\n| `{name}` |" in guide


def test_geneval_metadata_scored_by_geneval_reports_accuracy_of_its_verdicts(tmp_path, capsys, tiny_sd3_dir):
    """GenEval's metadata file scored by the geneval reward (default score: partial, what Flow-GRPO trains on):
    ``accuracy/<tag>`` is the share of strict verdicts per tag, not the mean partial score. Thresholds at 0
    keep every detection of the random detector, so an object found twice passes strictly with a partial
    score of 0: the two differ."""
    out_tiny = tmp_path / "tiny-geneval"
    assert main(["tiny-reward", "geneval", "--out", str(out_tiny)]) == 0
    lines = [
        {"tag": "single_object", "include": [{"class": "dog", "count": 1}], "prompt": "a photo of a dog"},
        {"tag": "counting", "include": [{"class": "cup", "count": 2}], "exclude": [{"class": "cup", "count": 3}],
         "prompt": "a photo of two cups"},
        {"tag": "single_object", "include": [{"class": "car", "count": 1}], "prompt": "a photo of a car"},
    ]
    prompts = tmp_path / "evaluation_metadata.jsonl"
    prompts.write_text("".join(json.dumps(line) + "\n" for line in lines))
    # the decoded pixels (jpeg_quality: null): the detections these samples were chosen on
    spec = (f"{{name: geneval, path: {out_tiny / 'detector'}, clip_path: {out_tiny / 'clip'}, threshold: 0.0, "
            "counting_threshold: 0.0, jpeg_quality: null}")
    out = tmp_path / "eval"
    code = main(["evaluate", "--model", str(tiny_sd3_dir), "--prompts", str(prompts), "--reward", spec,
                 "--steps", "2", "--out", str(out)])
    assert code == 0, capsys.readouterr().err
    metrics = json.loads((out / "metrics.json").read_text())
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    passed = [r["passed"]["geneval"] for r in rows]
    assert [r["all_passed"] for r in rows] == passed
    # these samples' verdicts and partial scores disagree, so an accuracy of the scores would be caught
    assert [float(p) for p in passed] != [r["score"] for r in rows]
    singles = (passed[0] + passed[2]) / 2
    assert metrics["accuracy/single_object"] == singles and metrics["accuracy/counting"] == float(passed[1])
    assert metrics["accuracy/overall"] == pytest.approx((singles + passed[1]) / 2)
    assert metrics["accuracy"] == pytest.approx(sum(passed) / 3) and metrics["geneval/accuracy"] == metrics["accuracy"]
    assert metrics["geneval"] == pytest.approx(sum(r["score"] for r in rows) / 3)  # the mean stays the partial's
    _, gallery_rows = gallery_from_evals([out], ["tiny"])
    assert [row.cells[0].all_passed for row in gallery_rows] == passed


def test_the_solver_changes_the_samples_and_is_recorded(tmp_path, capsys, tiny_sd3_dir):
    """``--solver dpm2`` samples with DPM-Solver++(2) from the same noise: other samples than Euler's, the same as
    the sampling loop gives with that solver."""
    import torch

    import pipelines
    from flowalign.evaluation import sample_seeded
    from flowalign.sampling import OdeSolver, rollout

    prompts = tmp_path / "p.txt"
    prompts.write_text("a red circle\na blue square\n")
    outs = {}
    for solver in ("euler", "dpm2"):
        out = tmp_path / solver
        code = main(["evaluate", "--model", str(tiny_sd3_dir), "--prompts", str(prompts), "--reward", "brightness",
                     "--steps", "4", "--solver", solver, "--out", str(out)])
        assert code == 0, capsys.readouterr().err
        outs[solver] = json.loads((out / "metrics.json").read_text())
    assert "solver" not in outs["euler"] and outs["dpm2"]["solver"] == "dpm2"
    assert outs["euler"]["brightness"] != outs["dpm2"]["brightness"]
    policy = pipelines.load(tiny_sd3_dir)
    noise = policy.initial_noise(1, torch.Generator().manual_seed(0))
    direct = rollout(policy, ["a red circle"], num_steps=4, sampler=OdeSolver("dpm2"), initial_noise=noise)
    assert torch.equal(sample_seeded(policy, ["a red circle"], seed=0, num_steps=4, solver="dpm2", progress=False),
                       direct.samples)
