"""What ``flowalign --help`` costs: building the parser (what ``--help`` does, every command's module imported)
loads none of the libraries that take seconds to import; a command imports them in its ``run``. Each check runs
in a fresh interpreter, where ``sys.modules`` holds only what building the parser imported."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from flowalign.cli.main import all_commands

REPO = Path(__file__).resolve().parents[3]

#: libraries that take seconds to import (torch ~2 s, diffusers ~5 s on two cores)
HEAVY = ("torch", "diffusers", "transformers", "peft")

#: commands whose parser still needs one of them: the first library it needs, and why
HEAVY_PARSERS = {
    "tiny": ("diffusers", "its FAMILY choices are the tiny models the family specs name (pipelines.tiny.twins), "
                          "and a spec is read from its family's module, which imports diffusers"),
    "sample": ("torch", "its --sampler choices are flowalign.sampling.SAMPLER_KINDS, and flowalign.sampling "
                        "imports torch"),
}


def heavy_imported_by(commands: list[str]) -> list[str]:
    """The :data:`HEAVY` libraries in ``sys.modules`` of a fresh interpreter after ``build_parser`` of ``commands``."""
    code = textwrap.dedent(f"""
        import json, sys
        from flowalign.cli.main import all_commands, build_parser
        build_parser({{name: all_commands()[name] for name in {commands!r}}})
        print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))
    """)
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_building_every_parser_imports_no_heavy_library():
    light = [name for name in all_commands() if name not in HEAVY_PARSERS]
    assert {"train", "evaluate", "gallery", "pretrain-tiny", "serve-judge", "tiny-reward"} <= set(light)
    assert heavy_imported_by(light) == [], "import it inside the command's run (or the function that needs it)"


def test_the_heavy_parsers_still_need_what_they_are_excused_for():
    """Each exception is still a command and still needs its library (drop it from HEAVY_PARSERS once it does
    not); ``sample`` needs no more than torch."""
    assert set(HEAVY_PARSERS) <= set(all_commands())
    for name, (library, _why) in HEAVY_PARSERS.items():
        loaded = heavy_imported_by([name])
        assert library in loaded, (name, loaded)
        if library == "torch":
            assert "diffusers" not in loaded, (name, loaded)
