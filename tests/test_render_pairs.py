"""scripts/render_pairs.py: an --out that already holds files is refused (untouched) unless --overwrite, which
keeps the user's other files; the folder is written atomically, so an interrupted rendering leaves nothing
half-written behind."""

import json
from pathlib import Path

import pytest

from tests.flowalign.test_atomic_writers import snapshot
from tests.scripts import load_script

render_pairs = load_script("render_pairs")
ARGS = ["--level", "easy", "--n", "2", "--size", "32", "--seed", "3"]


def run(out: Path, *extra: str) -> int:
    return render_pairs.main([*ARGS, "--out", str(out), *extra])


def test_a_new_folder_gets_the_pairs_and_their_images(tmp_path):
    out = tmp_path / "pairs"
    assert run(out) == 0
    rows = [json.loads(line) for line in (out / "pairs.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    assert all((out / r["chosen"]).is_file() and (out / r["rejected"]).is_file() for r in rows)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pairs"]  # no temporary beside it


@pytest.mark.parametrize("existing", ["users_file", "earlier_pairs"])
def test_a_folder_that_holds_files_is_refused_in_one_line_and_left_as_it_was(existing, tmp_path, capsys):
    out = tmp_path / "pairs"
    if existing == "users_file":
        out.mkdir()
        (out / "notes.txt").write_text("the user's own\n")
    else:
        assert run(out) == 0  # hours of rendering are not replaced unasked either
    before = snapshot(out)
    capsys.readouterr()
    assert render_pairs.main([*ARGS[:-1], "7", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"--out {out} already holds files" in err and "--overwrite" in err
    assert snapshot(out) == before


def test_overwrite_replaces_its_pairs_and_keeps_the_users_files(tmp_path):
    out = tmp_path / "pairs"
    assert run(out) == 0
    (out / "notes.txt").write_text("the user's own\n")
    old = (out / "pairs.jsonl").read_text()
    assert render_pairs.main([*ARGS[:-1], "7", "--out", str(out), "--overwrite"]) == 0
    assert (out / "notes.txt").read_text() == "the user's own\n"
    rows = [json.loads(line) for line in (out / "pairs.jsonl").read_text().splitlines()]
    assert (out / "pairs.jsonl").read_text() != old
    # the images folder is the new rendering's alone: the earlier run's images went with it
    assert sorted(p.name for p in (out / "images").iterdir()) == sorted({r["chosen"][7:] for r in rows}
                                                                       | {r["rejected"][7:] for r in rows})


def _interrupted(real):
    """``rendered_pairs`` that yields one pair, then is interrupted (Ctrl-C mid-rendering)."""

    def rendered_pairs(*args, **kwargs):
        for pair in real(*args, **kwargs):
            yield pair
            raise KeyboardInterrupt

    return rendered_pairs


@pytest.mark.parametrize("existing", [False, True])
def test_an_interrupted_rendering_leaves_no_partial_folder(existing, tmp_path, monkeypatch):
    out = tmp_path / "pairs"
    if existing:
        assert run(out) == 0
    before = snapshot(out) if existing else None
    monkeypatch.setattr(render_pairs, "rendered_pairs", _interrupted(render_pairs.rendered_pairs))
    with pytest.raises(KeyboardInterrupt):
        render_pairs.main([*ARGS[:-1], "7", "--out", str(out), "--overwrite"])
    if existing:
        assert snapshot(out) == before  # the earlier pairs whole, no temporary inside
    else:
        assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == (["pairs"] if existing else [])
