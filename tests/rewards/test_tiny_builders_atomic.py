"""The tiny reward builders write their folders atomically and never over a user's files, called directly as
well as through ``flowalign tiny-reward``: a builder that dies mid-write (a full disk) leaves the folder it was
replacing byte for byte as it was, with no temporary beside it; a folder holding a file the builder did not
write is refused (untouched) unless ``overwrite``, which keeps that file."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
import safetensors.torch
import torch
import transformers

from flowalign.errors import UserError
from tests.flowalign.test_atomic_writers import snapshot


def _dying(real):
    """``real`` that writes what it writes, then fails as on a full disk."""

    def dies(*args, **kwargs):
        real(*args, **kwargs)
        raise OSError(errno.ENOSPC, "No space left on device")

    return dies


def _vlm(folder: Path, seed: int = 0, **kw):
    from rewards.vlm_tiny import build_tiny_vlm

    return build_tiny_vlm(folder, family="qwen2_vl", seed=seed, **kw)


def _builder(target: str):
    import importlib

    module, _, attr = target.partition(":")
    return lambda folder, seed=0, **kw: getattr(importlib.import_module(module), attr)(folder, seed, **kw)


def _unified(folder: Path, seed: int = 0, **kw):
    from rewards.unified_reward import save_tiny_unified_reward

    return save_tiny_unified_reward(folder, **kw)  # seedless: a failing rewrite writes the same bytes


SAVE_PRETRAINED = (transformers.PreTrainedModel, "save_pretrained")
#: builder name → (write(folder, seed=, overwrite=), the saver the failing write dies in)
BUILDERS = {
    "open_clip": (_builder("rewards.tiny_rewards:save_tiny_open_clip"), (safetensors.torch, "save_file")),
    "hf_clip": (_builder("rewards.tiny_rewards:save_tiny_hf_clip"), SAVE_PRETRAINED),
    "aesthetic": (_builder("rewards.tiny_rewards:save_tiny_aesthetic"), (safetensors.torch, "save_file")),
    "dinov2": (_builder("rewards.tiny_rewards:save_tiny_dinov2"), SAVE_PRETRAINED),
    "imagereward": (_builder("rewards.imagereward:save_tiny_imagereward"), (torch, "save")),
    "geneval": (_builder("rewards.geneval.tiny:save_tiny_geneval"), SAVE_PRETRAINED),
    "owlv2": (_builder("rewards.geneval.tiny:save_tiny_owlv2"), SAVE_PRETRAINED),
    "got_ocr2": (_builder("rewards.ocr.tiny:save_tiny_got_ocr2"), SAVE_PRETRAINED),
    "unified_reward": (_unified, SAVE_PRETRAINED),
    # dies in its last file, after the base model and the adapter are written
    "videoalign": (_builder("rewards.videoalign:save_tiny_videoalign"), (torch, "save")),
    "vlm": (_vlm, SAVE_PRETRAINED),
}


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_a_builder_that_dies_mid_write_leaves_the_previous_folder(name, tmp_path, monkeypatch):
    write, (owner, attr) = BUILDERS[name]
    folder = tmp_path / name
    write(folder, seed=0)
    before = snapshot(folder)
    assert len(before) > 1
    with monkeypatch.context() as m:
        m.setattr(owner, attr, _dying(getattr(owner, attr)))
        with pytest.raises(OSError, match="No space left"):
            write(folder, seed=1)
    assert snapshot(folder) == before  # no partial file, no temporary inside, the first write's bytes
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]  # none beside it


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_a_builder_refuses_a_users_folder_unless_asked_and_then_keeps_the_users_file(name, tmp_path):
    write, _ = BUILDERS[name]
    folder = tmp_path / name
    folder.mkdir()
    (folder / "notes.txt").write_text("the user's own\n")
    with pytest.raises(UserError, match="holds files this command did not write"):
        write(folder)
    assert snapshot(folder) == {"notes.txt": b"the user's own\n"}
    write(folder, overwrite=True)
    assert (folder / "notes.txt").read_text() == "the user's own\n" and len(snapshot(folder)) > 2


def test_a_builder_called_inside_tiny_rewards_folder_writes_into_it(tmp_path, capsys):
    """Through ``flowalign tiny-reward`` the builder writes straight into the command's atomic folder: one
    marker, the command's, and the reward loads from it."""
    import rewards
    from flowalign.cli.main import main

    out = tmp_path / "aesthetic"
    assert main(["tiny-reward", "aesthetic", "--out", str(out)]) == 0
    hidden = sorted(p.name for p in out.rglob(".*"))
    assert hidden == [".flowalign-tiny-reward.json"]
    rewards.load("aesthetic", path=str(out))
