"""What ``flowalign --help`` costs: building the parser (what ``--help`` does, every command's module imported)
loads none of the libraries that take seconds to import; a command imports them in its ``run``. Each check runs
in a fresh interpreter, where ``sys.modules`` holds only what building the parser imported."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from flowalign.cli.main import all_commands

REPO = Path(__file__).resolve().parents[3]

#: libraries that take seconds to import (torch ~2 s, diffusers ~5 s on two cores)
HEAVY = ("torch", "diffusers", "transformers", "peft")


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
    """Choices that take a heavy import to list (``tiny``'s FAMILY, ``sample``'s --sampler) are listed on use."""
    commands = list(all_commands())
    assert {"train", "evaluate", "gallery", "pretrain-tiny", "serve-judge", "tiny", "sample"} <= set(commands)
    assert heavy_imported_by(commands) == [], "import it inside the command's run (or the function that needs it)"


def test_choices_listed_on_use_are_checked_and_shown_as_given_choices(capsys):
    """The lazily listed choices print and refuse as argparse's own: in the usage line, in the error."""
    from flowalign.cli.main import main
    from flowalign.sampling import SAMPLER_KINDS
    from pipelines.tiny import twins

    with pytest.raises(SystemExit):
        main(["tiny", "--help"])
    assert "{" + ",".join(twins()) + "}" in capsys.readouterr().out.replace("\n", "").replace(" ", "")
    with pytest.raises(SystemExit) as refused:
        main(["sample", "--model", "m", "--prompt", "p", "--out", "o.png", "--sampler", "heun"])
    assert refused.value.code == 2
    err = capsys.readouterr().err
    assert "argument --sampler: invalid choice: 'heun'" in err and all(repr(k) in err for k in SAMPLER_KINDS)
