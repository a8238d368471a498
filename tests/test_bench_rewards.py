"""``scripts/bench_rewards.py`` runs end to end on the tiny-reward folders and gives every reward a finite rate
(a smoke test of the benchmark; no timing is asserted)."""

import math

import pytest

from tests.scripts import load_script

bench = load_script("bench_rewards")


def test_tiny_run_gives_every_reward_a_finite_rate(tmp_path):
    args = bench.parse(["--tiny", "--batch", "2", "--size", "64", "--repeats", "1", "--json", str(tmp_path / "r.json")])
    rows = bench.run(args)
    assert [r["reward"] for r in rows] == [c.name for c in bench.CASES]
    assert all(math.isfinite(r["images_per_s"]) and r["images_per_s"] > 0 for r in rows)
    assert all(len(r["times_s"]) == 1 and r["threads"] == 2 for r in rows)
    assert (tmp_path / "r.json").read_text().count('"reward"') == len(rows)


def test_reward_specs_are_benchmarked_as_given_videos_too_and_an_unknown_name_is_refused(capsys):
    small = ["--batch", "2", "--size", "32", "--repeats", "2"]
    rows = bench.run(bench.parse(["--reward", "{name: saturation, weight: 2}", "--reward", "brightness", *small]))
    rows += bench.run(bench.parse(["--reward", "{name: brightness_video}", "--frames", "3", *small]))
    assert [r["reward"] for r in rows] == ["saturation", "brightness", "brightness_video"]
    assert all(len(r["times_s"]) == 2 and math.isfinite(r["images_per_s"]) for r in rows)
    assert "| videos/s |" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        bench.parse(["--only", "nonesuch"])
    assert "unknown reward" in capsys.readouterr().err
