"""The ``make_*_splits.py`` scripts (through their shared ``scripts/split_files.py``) rewrite the committed
benchmark splits byte for byte: the splits are a function of the fixed seeds alone."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.scripts import load_script

ASSETS = Path(__file__).resolve().parents[1] / "assets"


@pytest.mark.parametrize("benchmark", ["geneval", "ocr"])  # the quick ones; vvr* draw the same way, slower
def test_a_split_script_rewrites_the_committed_files(tmp_path, benchmark, capsys):
    load_script(f"make_{benchmark}_splits").main(["--out", str(tmp_path)])
    written = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*.jsonl"))
    committed = sorted(p.relative_to(ASSETS / benchmark) for p in (ASSETS / benchmark).rglob("*.jsonl"))
    assert written and written == committed
    for name in written:
        assert (tmp_path / name).read_bytes() == (ASSETS / benchmark / name).read_bytes(), name
    assert capsys.readouterr().out.count("(seed ") == len(written)  # one line per file written
