"""What the guide, the README and the CLI help name exists: repository paths, families, benchmarks."""

import re
from pathlib import Path

import pytest

from flowalign import families
from flowalign.benchmarks import available_benchmarks

REPO = Path(__file__).resolve().parents[1]
#: ``configs/...yaml`` and ``assets/...`` paths (one followed by ``/<name>`` or ``/*`` stops before it)
PATH = re.compile(r"\b(?:configs/[\w.+/-]+\.yaml|assets/[\w.+/-]*[\w+-])")
#: a placeholder such as ``assets/architectures/NAME`` is not a path
PLACEHOLDER = re.compile(r"[A-Z]{2,}")
DOCS = sorted((REPO / "docs" / "guide").glob("*.md")) + [REPO / "README.md"]
#: the command-line modules: their help strings name example files
CLI = sorted(p for d in ("flowalign/cli", "pipelines/cli", "rewards/cli") for p in (REPO / d).glob("*.py"))


def named_paths(path: Path) -> set[str]:
    return {m for m in PATH.findall(path.read_text()) if not PLACEHOLDER.search(m)}


@pytest.mark.parametrize("source", DOCS + CLI, ids=lambda p: str(p.relative_to(REPO)))
def test_every_configs_or_assets_path_named_exists(source):
    missing = sorted(p for p in named_paths(source) if not (REPO / p).exists())
    assert not missing, f"{source.relative_to(REPO)} names paths that do not exist: {missing}"


def test_the_path_scan_finds_the_paths_and_skips_placeholders(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("run `configs/tiny/flow_grpo_vvr.yaml` on assets/tiny-sd3-vvr, or model.path=assets/architectures/NAME "
                   "or assets/architectures/<name>; configs/flux.1-dev/gone.yaml.")
    assert named_paths(doc) == {"configs/tiny/flow_grpo_vvr.yaml", "assets/tiny-sd3-vvr", "assets/architectures",
                                "configs/flux.1-dev/gone.yaml"}


@pytest.mark.parametrize("doc", ["docs/guide/installation.md", "docs/guide/training.md"])
def test_the_family_lists_name_every_registered_family(doc):
    text = (REPO / doc).read_text()
    assert [f for f in families.names() if f"`{f}`" not in text] == []


def test_the_model_family_meaning_names_every_registered_family():
    """The configuration reference's ``model.family`` row (generated from flowalign/config.py's comment)."""
    lines = (REPO / "docs/guide/configuration.md").read_text().splitlines()
    (row,) = [line for line in lines if line.startswith("| `family` |")]
    listed = set(re.findall(r"\w+", row))
    assert [f for f in families.names() if f not in listed] == []


def test_the_bench_option_lists_every_registered_benchmark():
    """The evaluation guide's benchmark table has a row for each (the option's help is generated)."""
    lines = (REPO / "docs/guide/evaluation.md").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| `--bench` | prompts"))
    rows = [line for line in lines[start + 2:] if line.startswith("| `")]
    assert [b for b in available_benchmarks() if not any(r.startswith(f"| `{b}` ") for r in rows)] == []
