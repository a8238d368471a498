"""The model-family registry (flowalign.families): every registered family is complete, `flowalign plan`
sizes every published architecture and every tiny model without a traceback (every recipe:
tests/flowalign/cli/test_plan_recipes.py), and the core names no concrete family."""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

import pytest

from flowalign import families
from flowalign.cli.main import main
from flowalign.config import load_config
from flowalign.errors import UserError
from flowalign.paths import REPO_ROOT
from pipelines.tiny import twins

ARCH = REPO_ROOT / "assets" / "architectures"
SPECS = families.registry()


def test_every_family_is_complete_and_its_architectures_are_detected_as_it():
    assert sorted(SPECS) == families.names()
    for name, spec in SPECS.items():
        assert spec.pipelines and spec.transformers and spec.lora_targets and spec.tiny, name
        assert spec.architectures, f"{name}: add its published configs under assets/architectures/"
        for arch in spec.architectures:
            assert families.detect(ARCH / arch).name == name, arch
    shipped = {p.name for p in ARCH.iterdir() if p.is_dir()}
    assert shipped == {a for s in SPECS.values() for a in s.architectures}, "an architecture no family names"


def test_a_bad_family_is_one_line_listing_the_registered_ones():
    with pytest.raises(UserError) as err:
        load_config(None, ["model.family=sdxl"])
    message = str(err.value)
    assert "model.family" in message and "\n" not in message
    assert all(name in message for name in SPECS)
    assert load_config(None, ["model.family=wan"]).model.family == "wan"


#: published architectures that no recipe folder is named after (FLUX.2-dev, Z-Image, Qwen-Image-Edit):
#: planned with the tiny recipe, as `flowalign plan CONFIG model.path=assets/architectures/NAME` documents
UNRECIPED = sorted(a.name for a in ARCH.iterdir() if a.is_dir() and not (REPO_ROOT / "configs" / a.name).is_dir())


#: families whose transformer's forward the meta device cannot run (HunyuanVideo 1.5 gathers tokens by boolean
#: masks): the planner refuses them with the reason, which these tests check instead of a plan
VALUE_DEPENDENT = {"hunyuan_video15"}


def refused_as_value_dependent(folder: Path, code: int, err: str) -> bool:
    if families.detect(folder).name not in VALUE_DEPENDENT:
        return False
    assert code != 0 and "depends on tensor values" in err and "Traceback" not in err, err[-2000:]
    return True


@pytest.mark.parametrize("arch", UNRECIPED)
def test_plan_sizes_every_architecture_without_a_recipe(arch, capsys):
    code = main(["plan", str(REPO_ROOT / "configs/tiny/flow_grpo_vvr.yaml"), f"model.path={ARCH / arch}",
                 "trainer.batch_size=1", "--gpus", "8", "--gpu-memory", "141"])
    out = capsys.readouterr()
    if refused_as_value_dependent(ARCH / arch, code, out.err):
        return
    assert code == 0 and "Traceback" not in out.err, out.err[-2000:]
    assert f"({families.detect(ARCH / arch).name})" in out.out.splitlines()[0] and "memory per rank" in out.out


@pytest.mark.parametrize("tiny", list(twins()))
def test_plan_sizes_every_tiny_model(tiny, tiny_model_dir, capsys):
    folder = tiny_model_dir(tiny)
    code = main(["plan", str(REPO_ROOT / "configs/tiny/flow_grpo_vvr.yaml"), f"model.path={folder}"])
    out = capsys.readouterr()
    if refused_as_value_dependent(folder, code, out.err):
        return
    assert code == 0, out.err[-2000:]
    assert f"({families.detect(folder).name})" in out.out.splitlines()[0]


def code_tokens(path: Path) -> list[tuple[int, str]]:
    """``(line, text)`` of the names and string literals of a module, without its comments and docstrings."""
    found, previous = [], tokenize.NEWLINE
    for tok in tokenize.generate_tokens(io.StringIO(path.read_text(encoding="utf-8")).readline):
        docstring = tok.type == tokenize.STRING and previous in (tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT)
        if tok.type in (tokenize.NAME, tokenize.STRING) and not docstring:
            found.append((tok.start[0], tok.string))
        if tok.type not in (tokenize.COMMENT, tokenize.NL):
            previous = tok.type
    return found


def test_the_core_names_no_concrete_family():
    """Outside docstrings and comments, flowalign/ never spells a registered family or tiny model name (the
    shipped assets' folder names, e.g. the default model's or an architecture's, are file names: left out)."""
    names = set(SPECS) | set(twins())
    folders = [*(REPO_ROOT / "assets").iterdir(), *ARCH.iterdir()]
    assets = sorted((p.name for p in folders), key=len, reverse=True)
    word = re.compile(r"(?<![A-Za-z0-9_])(" + "|".join(map(re.escape, sorted(names, key=len, reverse=True)))
                      + r")(?![A-Za-z0-9_])")
    hits = []
    for path in sorted((REPO_ROOT / "flowalign").rglob("*.py")):
        for line, text in code_tokens(path):
            for asset in assets:
                text = text.replace(asset, "")
            hits += [f"{path.relative_to(REPO_ROOT)}:{line}: {m.group(1)}" for m in word.finditer(text)]
    assert not hits, "the core reads families from the registry (flowalign.families):\n" + "\n".join(hits)


def test_the_name_check_sees_code_and_skips_docstrings(tmp_path):
    module = tmp_path / "m.py"
    module.write_text('"""About sd3."""\n\n# wan here\nx = "flux"\n\n\ndef f():\n    """Doc of zimage."""\n    return 1\n')
    assert [t for _, t in code_tokens(module) if "sd3" in t or "flux" in t or "zimage" in t or "wan" in t] == ['"flux"']
