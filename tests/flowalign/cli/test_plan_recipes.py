"""``flowalign plan RECIPE`` on every shipped recipe as written, on one GPU and on eight: exit 0, no traceback,
no data file read.

A recipe for a released model names a placeholder ``model.path`` (``/path/to/FLUX.1-dev``) and often
placeholder prompt files: the plan stands in the published architecture of its ``configs/`` folder, says
so in its first line, and sizes memory without reading a prompt."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

import flowalign.train
from flowalign.cli.main import main
from flowalign.paths import REPO_ROOT
from flowalign.plan import SAME_ARCHITECTURE

RECIPES = sorted(p.relative_to(REPO_ROOT).as_posix() for p in (REPO_ROOT / "configs").glob("*/*.yaml"))


def test_the_recipe_list_covers_every_folder_of_configs():
    folders = {p.name for p in (REPO_ROOT / "configs").iterdir() if p.is_dir() and any(p.glob("*.yaml"))}
    assert {Path(r).parts[1] for r in RECIPES} == folders and "tiny" in folders and len(folders) > 5


@pytest.mark.parametrize("recipe", RECIPES)
def test_plan_runs_on_every_shipped_recipe_as_written(recipe, capsys, monkeypatch):
    def no_prompt_files(path, *args, **kwargs):
        raise AssertionError(f"plan read the prompt file {path}")

    monkeypatch.setattr(flowalign.train, "read_prompt_file", no_prompt_files)
    monkeypatch.chdir(REPO_ROOT)
    rc = main(["plan", recipe])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "Traceback" not in err and not err.startswith("error:")
    lines = out.splitlines()
    model_path = yaml.safe_load((REPO_ROOT / recipe).read_text())["model"]["path"]
    if (REPO_ROOT / model_path).exists():
        assert lines[0].startswith(f"model {model_path} ("), lines[0]
    else:  # a placeholder: the published architecture of the recipe's folder, said first
        arch = f"assets/architectures/{SAME_ARCHITECTURE.get(Path(recipe).parts[1], Path(recipe).parts[1])}"
        assert lines[0] == (f"model.path {model_path} does not exist: planning on the published architecture "
                            f"{arch} (its configs, no weights)")
        assert lines[1].startswith(f"model {REPO_ROOT / arch} (")
    assert any(line.startswith("  rollouts of the step") for line in lines)
    assert lines[-1].startswith(("ddp: fits", "ddp: does not fit"))
    # on 8 GPUs: memory per rank for each strategy (the meta forward is cached: no second one)
    rc = main(["plan", recipe, "--gpus", "8", "--gpu-memory", "80"])
    out, err = capsys.readouterr()
    assert rc == 0 and "Traceback" not in err, err[-2000:]
    assert "memory per rank" in out and "  transformer " in out
