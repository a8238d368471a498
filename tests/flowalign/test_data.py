"""Prompt files: a JSONL ``image`` (input image of an editing / image-to-video prompt) is resolved against the file."""

import json

import pytest

from flowalign.data import read_prompt_file
from flowalign.errors import UserError


def test_jsonl_image_paths_are_relative_to_the_file(tmp_path, monkeypatch):
    folder = tmp_path / "set"
    (folder / "inputs").mkdir(parents=True)
    (folder / "inputs" / "a.png").write_bytes(b"")
    path = folder / "edits.jsonl"
    path.write_text('{"prompt": "make it blue", "image": "inputs/a.png", "level": "easy"}\n{"prompt": "plain"}\n')
    monkeypatch.chdir(tmp_path)  # resolution must not depend on the working directory
    data = read_prompt_file("set/edits.jsonl")
    assert data.prompts == ["make it blue", "plain"]
    assert data.metadata[0] == {"image": str((folder / "inputs" / "a.png").resolve()), "level": "easy"}
    assert data.metadata[1] == {}


@pytest.mark.parametrize("value", ['""', "3", "null"])
def test_bad_image_field_is_a_user_error(tmp_path, value):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "x", "image": %s}\n' % value)
    with pytest.raises(UserError, match='bad.jsonl:1: "image" must be a path string'):
        read_prompt_file(path)


def test_a_prompt_over_the_bound_names_its_line(tmp_path):
    from flowalign.limits import MAX_PROMPT_CHARS

    txt = tmp_path / "p.txt"
    txt.write_text("a red circle\n" + "x" * (MAX_PROMPT_CHARS + 1) + "\n")
    with pytest.raises(UserError, match="p.txt: prompt 2: a prompt of 20,001 characters"):
        read_prompt_file(txt)
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text(json.dumps({"prompt": "y" * (MAX_PROMPT_CHARS + 1)}) + "\n")
    with pytest.raises(UserError, match="p.jsonl:1: a prompt of 20,001 characters"):
        read_prompt_file(jsonl)
    txt.write_text("z" * MAX_PROMPT_CHARS + "\n")
    assert len(read_prompt_file(txt).prompts[0]) == MAX_PROMPT_CHARS


def test_geneval_metadata_and_plain_text_prompt_sets_are_read_as_they_are(tmp_path):
    # GenEval's metadata file: each line is the sample's metadata, its "prompt" the prompt
    rows = [{"tag": "counting", "include": [{"class": "dog", "count": 2}], "prompt": "a photo of two dogs"},
            {"tag": "colors", "include": [{"class": "car", "count": 1, "color": "red"}], "exclude": [],
             "prompt": "a photo of a red car"}]
    path = tmp_path / "evaluation_metadata.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    prompts = read_prompt_file(path)
    assert prompts.prompts == ["a photo of two dogs", "a photo of a red car"]
    assert prompts.metadata == [{k: v for k, v in r.items() if k != "prompt"} for r in rows]
    # a plain list (OCR, PickScore prompt sets): one prompt a line, blank lines and edge spaces dropped
    text = tmp_path / "test.txt"
    text.write_text('A sign that says "OPEN"\n\n  a cat on a mat  \n')
    plain = read_prompt_file(text)
    assert plain.prompts == ['A sign that says "OPEN"', "a cat on a mat"] and plain.metadata == [{}, {}]


@pytest.mark.parametrize("line,key", [('{"prompt": "a cat", "prompt": "a dog"}', "prompt"),
                                      ('{"prompt": "a", "task": {"n": 1, "n": 2}}', "n")])
def test_a_jsonl_key_given_twice_is_refused_with_its_line(tmp_path, line, key):
    """``json`` keeps the last of a repeated key silently; a prompt file's line names the key instead."""
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "fine"}\n' + line + "\n")
    with pytest.raises(UserError, match=f"p.jsonl:2: key '{key}' is given twice in one object"):
        read_prompt_file(path)


def test_a_jsonl_line_of_prompt_segments_reads_as_its_first_prompt_with_every_segment_kept(tmp_path):
    """LongLive's interactive prompt files: ``{"prompts": [...]}`` a line, the segments of a video that switches
    prompts."""
    path = tmp_path / "segments.jsonl"
    path.write_text('{"prompts": ["a boy stands", "the boy runs"]}\n{"prompts": []}\n')
    with pytest.raises(UserError, match='segments.jsonl:2: "prompts" must be a non-empty list'):
        read_prompt_file(path)
    path.write_text('{"prompts": ["a boy stands", "the boy runs"]}\n')
    data = read_prompt_file(path)
    assert data.prompts == ["a boy stands"] and data.metadata == [{"prompts": ["a boy stands", "the boy runs"]}]
