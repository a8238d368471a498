"""flowalign.plugins: the CLI commands, benchmarks, renderers, families and encoders that the other packages
contribute."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest
import torch

import pipelines
import rewards
from flowalign.benchmarks import available_benchmarks, load_benchmark, render_task
from flowalign.cli.main import all_commands, core_commands, main
from flowalign.errors import UserError
from flowalign.plugins import load_target, targets

REPO = Path(__file__).resolve().parents[2]


def test_pyproject_entry_points_are_the_built_in_tables():
    """The entry points that an install registers and the tables a source checkout reads agree."""
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["entry-points"]
    for kind in ("commands", "benchmarks", "renderers", "families", "encoders"):
        tables = {**rewards.PLUGINS.get(kind, {}), **pipelines.PLUGINS.get(kind, {})}
        assert declared[f"flowalign.{kind}"] == tables, kind


def test_every_target_loads():
    for kind in ("commands", "benchmarks", "renderers", "families", "encoders"):
        for name, target in targets(kind).items():
            assert load_target(target) is not None, (kind, name)


def test_help_lists_every_command(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    names = set(all_commands())
    assert {"train", "sample", "evaluate", "gallery", "tiny", "serve-judge", "train-reward"} <= names
    assert all(name in out for name in names)


def test_running_a_core_command_imports_no_other_command():
    code = textwrap.dedent("""
        import sys
        from flowalign.cli.main import main
        try:
            main(["train", "--help"])
        except SystemExit:
            pass
        loaded = [m for m in sys.modules if m.startswith(("rewards", "pipelines", "flowalign.cli."))]
        print(sorted(loaded))
    """)
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "['flowalign.cli.main', 'flowalign.cli.train']"


def test_a_rewards_command_does_not_import_the_model_families():
    code = textwrap.dedent("""
        import sys
        from flowalign.cli.main import main
        try:
            main(["serve-judge", "--help"])
        except SystemExit:
            pass
        print(sorted(m for m in sys.modules if m.startswith("pipelines")), "rewards.cli.serve_judge" in sys.modules)
    """)
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[] True"


def test_core_commands_are_the_modules_of_the_cli_package():
    found = core_commands()
    assert found["train"] == "flowalign.cli.train" and "main" not in found and "common" not in found


def _install(tmp_path: Path, monkeypatch, module: str, source: str, entry_points: str) -> None:
    """A third-party distribution on sys.path: ``module.py`` and a dist-info declaring ``entry_points``."""
    (tmp_path / f"{module}.py").write_text(textwrap.dedent(source))
    info = tmp_path / f"{module}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(textwrap.dedent(entry_points))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, module, raising=False)


def test_a_command_from_an_installed_package(tmp_path, monkeypatch, capsys):
    _install(tmp_path, monkeypatch, "plugin_hello", """
        def add_parser(sub):
            p = sub.add_parser("hello", help="say hello to a name")
            p.add_argument("who")
            return p

        def run(args):
            print(f"hello {args.who}")
    """, "[flowalign.commands]\nhello = plugin_hello\n")
    assert main(["hello", "world"]) == 0
    assert capsys.readouterr().out == "hello world\n"
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "say hello to a name" in capsys.readouterr().out


def test_a_benchmark_and_renderer_from_an_installed_package(tmp_path, monkeypatch):
    _install(tmp_path, monkeypatch, "plugin_bench", """
        from PIL import Image
        from flowalign.benchmarks import Benchmark

        def load(level, split, n, seed):
            prompts = [f"{level} prompt {i}" for i in range(n or 3)]
            return Benchmark(f"dots-{level}", prompts, [{"i": i} for i in range(len(prompts))], reward=None)

        def render(metadata, size):
            return Image.new("RGB", (size, size), (255, 0, 0) if metadata["i"] == 0 else (0, 0, 255))
    """, "[flowalign.benchmarks]\ndots = plugin_bench:load\n[flowalign.renderers]\ndots = plugin_bench:render\n")
    assert "dots" in available_benchmarks() and "vvr" in available_benchmarks()
    bench = load_benchmark("dots", "hard", n=2)
    assert bench.name == "dots-hard" and bench.prompts == ["hard prompt 0", "hard prompt 1"]
    image = render_task("dots", {"i": 0}, 8)
    assert image.shape == (3, 8, 8) and image[0].min() == 1.0 and image[2].max() == 0.0


def test_the_built_in_renderers_give_images_and_clips_in_unit_range():
    import numpy as np

    from rewards.vvr import generate_tasks, render

    task = generate_tasks(1, seed=3, level="easy")[0]
    image = render_task("vvr", {"task": task.to_dict()}, 32)
    expected = np.asarray(render(task, size=32).convert("RGB"), dtype=np.float32) / 255
    assert image.shape == (3, 32, 32) and torch.equal(image, torch.from_numpy(expected).permute(2, 0, 1))
    motion = load_benchmark("vvr_motion", "easy", n=1, seed=5)
    clip = render_task("vvr_motion", motion.metadata[0], 16)
    assert clip.shape == (9, 3, 16, 16) and 0 <= clip.min() and clip.max() <= 1 and clip.std() > 0


def test_unknown_names_are_user_errors():
    with pytest.raises(UserError, match="unknown benchmark 'nope'.*vvr"):
        load_benchmark("nope")
    with pytest.raises(UserError, match=r"cannot render its tasks \(only (\w+, )*vvr_motion\)"):
        render_task("dots", {}, 8)
    with pytest.raises(UserError, match="--n must be a positive"):
        load_benchmark("vvr", n=0)
    with pytest.raises(UserError, match="unknown level 'extreme'"):
        load_benchmark("vvr", "extreme")
