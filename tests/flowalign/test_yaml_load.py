"""User YAML: a key given twice and alias bombs are one-line errors; anchors and merge keys still work."""

import time

import pytest

from flowalign.config import load_config
from flowalign.errors import UserError
from flowalign.limits import MAX_CONFIG_BYTES
from flowalign.yaml_load import load_yaml

BILLION_LAUGHS = "a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + "".join(
    f"{n}: &{n} [{', '.join(['*' + p] * 9)}]\n" for p, n in zip("abcdefgh", "bcdefghi"))


def test_a_key_given_twice_names_the_key_and_both_lines(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("run:\n  seed: 1\n  name: x\n  seed: 2\n")
    with pytest.raises(UserError) as info:
        load_config(cfg)
    assert "line 4: key 'seed' is given twice in one mapping (first on line 2)" in str(info.value)
    assert str(cfg) in str(info.value) and "\n" not in str(info.value)


def test_the_same_key_in_different_mappings_and_merge_overrides_are_fine():
    data = load_yaml("base: &b {lr: 1, seed: 2}\nrun: {seed: 3}\ntrainer:\n  <<: *b\n  lr: 5\n")
    assert data["trainer"] == {"lr": 5, "seed": 2} and data["run"] == {"seed": 3}


def test_alias_bomb_is_refused_before_it_expands(tmp_path):
    cfg = tmp_path / "bomb.yaml"
    cfg.write_text(BILLION_LAUGHS)
    start = time.process_time()
    with pytest.raises(UserError, match="aliases .* expand to more than 100,000 values"):
        load_config(cfg)
    assert time.process_time() - start < 5  # counted on the node graph, never expanded
    with pytest.raises(UserError, match="override data.level: its aliases"):
        load_config(None, ["data.level=" + BILLION_LAUGHS.replace("\n", ", ").join("{}")])


def test_an_alias_inside_its_own_value_is_refused():
    with pytest.raises(UserError, match="an alias refers to a value that contains it"):
        load_yaml("a: &x [1, *x]\n")


def test_a_huge_config_file_is_refused_unread(tmp_path):
    cfg = tmp_path / "big.yaml"
    with cfg.open("wb") as f:
        f.truncate(MAX_CONFIG_BYTES + 1)
    with pytest.raises(UserError, match="MiB, more than the 10 MiB"):
        load_config(cfg)


def test_a_syntax_error_is_one_line_with_its_line(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("run:\n  seed: [1, 2\n")
    with pytest.raises(UserError) as info:
        load_config(cfg)
    assert "not valid YAML (line" in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("text,line", [("{a: 1, a: 2}", 1), ("x: {a: 1,\n  b: 2, a: 3}", 2), ("- {k: 1, k: 1}", 1)])
def test_a_key_given_twice_in_a_flow_mapping_is_refused(text, line):
    """``{a: 1, a: 2}`` keeps its last value in plain PyYAML, both keys on one line."""
    with pytest.raises(UserError, match=f"cfg: line {line}: key '[ak]' is given twice in one mapping"):
        load_yaml(text, "cfg")


def test_an_override_with_a_flow_mapping_key_given_twice_is_refused():
    with pytest.raises(UserError, match="key 'name' is given twice"):
        load_config(None, ["rewards=[{name: vvr, weight: 1, name: ocr}]"])
