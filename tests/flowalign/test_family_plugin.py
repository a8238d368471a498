"""A model family from another package, registered through the ``flowalign.families`` entry point alone: the
walk-through of docs/guide/adding-a-model-family.md, step by step. ``flowalign tiny``, ``sample``, ``plan`` and
``model.family`` use it with no edit to flowalign or pipelines."""

from __future__ import annotations

import sys
import textwrap

import pytest

from flowalign import families
from flowalign.cli.main import main
from flowalign.config import load_config
from flowalign.paths import REPO_ROOT

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
    cfg="cfg", transformer_inputs=sd3.transformer_inputs, tiny={"plugin_mmdit": "plugin_family"},
)
'''


def install(tmp_path, monkeypatch) -> None:
    """Step 3: the package's entry point, as pip would install it (a dist-info on sys.path)."""
    (tmp_path / "plugin_family.py").write_text(textwrap.dedent(FAMILY))
    info = tmp_path / "plugin_family-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: plugin-family\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[flowalign.families]\nplugin_mmdit = plugin_family:SPEC\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "plugin_family", raising=False)


def test_a_family_from_an_installed_package_is_built_sampled_and_planned(tmp_path, monkeypatch, capsys):
    install(tmp_path, monkeypatch)
    assert "plugin_mmdit" in families.names() and load_config(None, ["model.family=plugin_mmdit"]).model.family

    model = tmp_path / "model"
    assert main(["tiny", "plugin_mmdit", "--out", str(model)]) == 0
    assert families.detect(model).name == "plugin_mmdit"
    out = tmp_path / "sample.png"
    code = main(["sample", "--model", str(model), "--prompt", "a red circle", "--steps", "2", "--out", str(out)])
    assert code == 0 and out.stat().st_size > 0, capsys.readouterr().err

    capsys.readouterr()
    code = main(["plan", str(REPO_ROOT / "configs/tiny/flow_grpo_vvr.yaml"), f"model.path={model}",
                 "model.family=plugin_mmdit"])
    report = capsys.readouterr()
    assert code == 0, report.err
    assert "(plugin_mmdit)" in report.out.splitlines()[0] and "memory per rank" in report.out


def test_without_the_entry_point_the_family_is_unknown(tmp_path, capsys):
    assert "plugin_mmdit" not in families.names()
    with pytest.raises(SystemExit) as done:
        main(["tiny", "plugin_mmdit", "--out", str(tmp_path / "m")])
    assert done.value.code == 2 and "invalid choice: 'plugin_mmdit'" in capsys.readouterr().err
