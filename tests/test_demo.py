"""scripts/demo.py (``make demo``): plan line, training, test-split scores, reuse of a finished run."""

import json
import re

from tests.scripts import SCRIPTS, load_script

CONFIG = str(SCRIPTS.parent / "configs" / "tiny" / "demo.yaml")


def test_demo_trains_scores_on_test_and_reuses_the_finished_run(tmp_path, tiny_sd3_dir, capsys):
    demo = load_script("demo")
    overrides = [f"run.output_dir={tmp_path / 'run'}", f"model.path={tiny_sd3_dir}", "run.progress=false",
                 "run.tensorboard=false", "trainer.max_steps=1", "trainer.prompts_per_step=1", "trainer.group_size=2",
                 "trainer.batch_size=2", "trainer.num_steps=2", "data.n=8", "eval.n=2", "eval.num_steps=2"]
    line = demo.run_demo(CONFIG, overrides, n_test=3)
    out = capsys.readouterr().out
    assert out.startswith("demo: fine-tune") and "1 steps" in out and "minutes on 2 cores" in out
    assert "gallery (base vs tuned on test)" in out and (tmp_path / "run" / "test" / "gallery" / "index.html").is_file()
    m = re.fullmatch(r"demo: test accuracy (\d\.\d{3}) -> (\d\.\d{3}) \(([+-]\d+\.\d) points, (\d+) wins / (\d+) losses, n=3\)", line)
    assert m, line
    before, after = (json.loads((tmp_path / "run" / "test" / d / "metrics.json").read_text())
                     for d in ("base", "step-000001"))
    assert before["split"] == after["split"] == "test" and after["adapter"].endswith("step-000001")
    assert float(m[1]) == round(before["accuracy"], 3) and float(m[2]) == round(after["accuracy"], 3)
    # the validation evaluation during training read the validation split, never test
    assert json.loads((tmp_path / "run" / "evals" / "step-000001" / "metrics.json").read_text())["split"] == "validation"

    again = demo.run_demo(CONFIG, overrides, n_test=3)
    assert again == line and "reusing the finished run" in capsys.readouterr().out
