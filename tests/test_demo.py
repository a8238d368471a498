"""scripts/demo.py (``make demo``): plan line, training, test-split scores, reuse of a finished run."""

import json
import os
import re
import subprocess
import sys

import pytest

from flowalign.errors import UserError
from tests.scripts import SCRIPTS, load_script

CONFIG = str(SCRIPTS.parent / "configs" / "tiny" / "demo.yaml")


def test_demo_trains_scores_on_test_and_reuses_the_finished_run(tmp_path, tiny_sd3_dir, capsys):
    demo = load_script("demo")
    overrides = [f"run.output_dir={tmp_path / 'run'}", f"model.path={tiny_sd3_dir}", "run.progress=false",
                 "run.tensorboard=false", "trainer.max_steps=1", "trainer.prompts_per_step=1", "trainer.group_size=2",
                 "trainer.batch_size=2", "trainer.num_steps=2", "data.n=8", "eval.n=2", "eval.num_steps=2"]
    # beside another busy test worker a base evaluation at nice 19 starves (142 s measured, 20 s at nice 0);
    # its priority has its own test below
    line = demo.run_demo(CONFIG, overrides, n_test=3, background_niceness=0)
    out = capsys.readouterr().out
    assert out.startswith("demo: fine-tune") and "1 steps" in out and "minutes on 2 cores" in out
    assert "gallery (base vs tuned on test)" in out and (tmp_path / "run" / "test" / "gallery" / "index.html").is_file()
    m = re.fullmatch(r"demo: test accuracy (\d\.\d{3}) -> (\d\.\d{3}) \(([+-]\d+\.\d) points, (\d+) wins / (\d+) losses, n=3\)", line)
    assert m, line
    before, after = (json.loads((tmp_path / "run" / "test" / d / "metrics.json").read_text())
                     for d in ("base", "step-000001"))
    assert before["split"] == after["split"] == "test" and after["adapter"].endswith("step-000001")
    # paired: the base model itself against the tuned one, the same prompts and the same noise
    assert before["adapter"] is None and before["seed"] == after["seed"] and before["n"] == after["n"] == 3
    assert float(m[1]) == round(before["accuracy"], 3) and float(m[2]) == round(after["accuracy"], 3)
    # the validation evaluation during training read the validation split, never test
    assert json.loads((tmp_path / "run" / "evals" / "step-000001" / "metrics.json").read_text())["split"] == "validation"

    again = demo.run_demo(CONFIG, overrides, n_test=3, background_niceness=0)
    assert again == line and "reusing the finished run" in capsys.readouterr().out


def test_background_test_evaluation_runs_at_the_lowest_priority(tmp_path, tiny_sd3_dir):
    demo = load_script("demo")
    cfg = demo.load_config(CONFIG, [f"model.path={tiny_sd3_dir}", "eval.num_steps=2"])
    folder = tmp_path / "test" / "base"
    proc = demo.start_test_evaluation(cfg, folder, None, 2, background=True)
    try:
        assert os.getpriority(os.PRIO_PROCESS, proc.pid) == 19
        assert (tmp_path / "test" / "base.log").is_file()
    finally:
        proc.terminate()
        proc.wait()
    # a folder that already holds its metrics is not evaluated again
    folder.mkdir(parents=True)
    (folder / "metrics.json").write_text("{}")
    assert demo.start_test_evaluation(cfg, folder, None, 2, background=True) is None


def test_a_failed_test_evaluation_names_its_log(tmp_path):
    demo = load_script("demo")
    folder = tmp_path / "base"
    (tmp_path / "base.log").write_text("Traceback ...")
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    with pytest.raises(UserError, match=r"failed \(exit 3\); its log: .*base\.log"):
        demo.wait_for(proc, folder)
    assert demo.wait_for(None, folder) == folder
