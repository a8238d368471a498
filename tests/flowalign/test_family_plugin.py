"""A package outside the repository's packages that registers a model family (entry-point group
``flowalign.families``) and a trainer (``flowalign.trainers``), and nothing else: the walk-throughs of
docs/guide/adding-a-model-family.md and docs/guide/adding-a-trainer.md, step by step. ``flowalign tiny``,
``sample``, ``train``, ``train --check``, ``plan`` and ``model.family`` use both with no edit to flowalign,
pipelines or rewards."""

from __future__ import annotations

import json
import re
import sys
import textwrap

import pytest

from flowalign import families
from flowalign.cli.main import main
from flowalign.config import load_config
from flowalign.paths import REPO_ROOT
from flowalign.trainers import get_trainer, registered

#: the family file (step 1: the policy; step 2: its transformer inputs and spec; step 4: its tiny twin). This
#: one serves SD3's components under a pipeline class of its own, so its policy is SD3's with that class.
FAMILY = '''
from diffusers import StableDiffusion3Pipeline

from flowalign.families import FamilySpec
from pipelines import sd3
from pipelines.tiny import build_tiny_sd3


class PluginPipeline(StableDiffusion3Pipeline):
    """What a folder of this family names in model_index.json."""


class PluginPolicy(sd3.SD3Policy):
    family = "plugin_mmdit"
    pipeline_class = PluginPipeline


def build(**overrides):
    return PluginPipeline(**build_tiny_sd3(**overrides).components)


SAMPLING = {"height": 32, "width": 32, "num_frames": None, "guidance_scale": 4.0, "num_steps": 4,
            "max_sequence_length": 32}

SPEC = FamilySpec(
    name="plugin_mmdit", policy=PluginPolicy, pipelines=("PluginPipeline",), transformers=("SD3Transformer2DModel",),
    lora_targets=("to_q", "to_k", "to_v", "to_out.0"),
    size={"height": 1024, "width": 1024, "num_frames": None, "max_sequence_length": 256}, num_steps=40, guidance=4.5,
    cfg="cfg", transformer_inputs=sd3.transformer_inputs, tiny={"plugin_mmdit": "plugin_lab.family"},
)
'''


def guide_trainer() -> str:
    """The trainer file of docs/guide/adding-a-trainer.md, as the guide prints it (``# my_lab/trainers.py``)."""
    guide = (REPO_ROOT / "docs" / "guide" / "adding-a-trainer.md").read_text()
    (block,) = [b for b in re.findall(r"```python\n(.*?)```", guide, re.S) if b.startswith("# my_lab/trainers.py")]
    return block


def install(tmp_path, monkeypatch) -> None:
    """Step 3 of both guides: the package and its entry points, as pip would install them (a dist-info on
    sys.path). The package lives in a temporary folder: nothing of it is in the repository's packages."""
    package = tmp_path / "site" / "plugin_lab"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "family.py").write_text(textwrap.dedent(FAMILY))
    (package / "trainers.py").write_text(guide_trainer())
    info = tmp_path / "site" / "plugin_lab-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: plugin-lab\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[flowalign.families]\nplugin_mmdit = plugin_lab.family:SPEC\n\n"
                                           "[flowalign.trainers]\ntoy = plugin_lab.trainers:ToyTrainer\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    for name in ("plugin_lab", "plugin_lab.family", "plugin_lab.trainers"):
        monkeypatch.delitem(sys.modules, name, raising=False)


def test_a_family_and_a_trainer_from_an_installed_package_are_built_sampled_trained_and_planned(
        tmp_path, monkeypatch, capsys):
    install(tmp_path, monkeypatch)
    assert "plugin_mmdit" in families.names() and load_config(None, ["model.family=plugin_mmdit"]).model.family
    assert registered()["toy"] == "plugin_lab.trainers:ToyTrainer" and get_trainer("toy").__module__ == "plugin_lab.trainers"

    model = tmp_path / "model"
    assert main(["tiny", "plugin_mmdit", "--out", str(model)]) == 0
    assert families.detect(model).name == "plugin_mmdit"
    out = tmp_path / "sample.png"
    code = main(["sample", "--model", str(model), "--prompt", "a red circle", "--steps", "2", "--out", str(out)])
    assert code == 0 and out.stat().st_size > 0, capsys.readouterr().err

    # the guide's trainer on the guide's family, by its entry-point name, from the command line
    (tmp_path / "prompts.txt").write_text("a red circle\na blue square\n")
    run = tmp_path / "run"
    train = ["/dev/null", f"model.path={model}", "model.family=plugin_mmdit", "trainer.name=toy", "rewards=[]",
             f"data.prompts={tmp_path / 'prompts.txt'}", "eval.bench=null", "run.progress=false",
             "run.tensorboard=false", "trainer.max_steps=2", "model.lora.rank=4", f"run.output_dir={run}"]
    capsys.readouterr()
    assert main(["train", "--check", *train]) == 0 and not run.exists()
    assert "config OK (trainer toy" in capsys.readouterr().out
    assert main(["train", *train]) == 0, capsys.readouterr().err
    logs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    trained = [entry for entry in logs if "train/seen" in entry]
    assert [entry["train/seen"] for entry in trained] == [4.0, 8.0]  # the guide's finish(): 4 samples a step
    assert all(entry["train/loss"] > 0 for entry in trained)

    capsys.readouterr()
    code = main(["plan", str(REPO_ROOT / "configs/tiny/flow_grpo_vvr.yaml"), f"model.path={model}",
                 "model.family=plugin_mmdit"])
    report = capsys.readouterr()
    assert code == 0, report.err
    assert "(plugin_mmdit)" in report.out.splitlines()[0] and "memory per rank" in report.out


def test_without_the_entry_point_the_family_is_unknown(tmp_path, capsys):
    assert "plugin_mmdit" not in families.names() and "toy" not in registered()
    with pytest.raises(SystemExit) as done:
        main(["tiny", "plugin_mmdit", "--out", str(tmp_path / "m")])
    assert done.value.code == 2 and "invalid choice: 'plugin_mmdit'" in capsys.readouterr().err
