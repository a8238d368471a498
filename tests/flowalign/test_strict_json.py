"""Results JSON is RFC 8259 JSON: a non-finite number is written as null, never as NaN or Infinity."""

import json

from flowalign import strict_json
from flowalign.io import write_json, write_jsonl


def strict_loads(text):
    def refuse(token):
        raise AssertionError(f"{token} is not JSON")

    return json.loads(text, parse_constant=refuse)


def test_non_finite_numbers_become_null_at_any_depth():
    data = {"a": float("nan"), "b": [1.0, float("inf"), {"c": -float("inf")}], "d": (2, "x"), "e": True}
    assert strict_loads(strict_json.dumps(data)) == {"a": None, "b": [1.0, None, {"c": None}], "d": [2, "x"], "e": True}


def test_written_results_are_strict_json(tmp_path):
    write_json(tmp_path / "m.json", {"mean_score": float("nan"), "n": 3})
    write_jsonl(tmp_path / "r.jsonl", [{"score": float("nan")}, {"score": 0.5}])
    assert strict_loads((tmp_path / "m.json").read_text()) == {"mean_score": None, "n": 3}
    assert [strict_loads(line) for line in (tmp_path / "r.jsonl").read_text().splitlines()] == [
        {"score": None}, {"score": 0.5}]
