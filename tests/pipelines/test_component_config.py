"""A model folder whose component ``config.json`` is wrong is one line when it is loaded for train or
sample: a value of the wrong kind or out of range before diffusers builds anything, sizes that do not match
the weights once diffusers refuses them (naming the component and the weight)."""

from __future__ import annotations

import json
import shutil

import pytest

import pipelines
from flowalign.cli.main import main
from flowalign.component_config import check_settings
from flowalign.errors import UserError
from flowalign.paths import REPO_ROOT

TINY = REPO_ROOT / "assets" / "tiny-sd3-vvr"


def _copy(tmp_path, component="transformer", **changes):
    folder = tmp_path / "model"
    shutil.copytree(TINY, folder)
    path = folder / component / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    return folder


@pytest.mark.parametrize("changes,message", [
    ({"num_layers": -5}, "transformer/config.json: num_layers=-5 must be between 1 and 1,024"),  # loaded silently before
    ({"num_layers": "many"}, 'transformer/config.json: num_layers="many" must be a whole number'),
    ({"num_layers": 10**9}, "transformer/config.json: num_layers=1000000000 must be between 1 and 1,024"),
    ({"patch_size": 0}, "transformer/config.json: patch_size=0 must be between 1 and"),
    ({"num_attention_heads": True}, "num_attention_heads=true must be a whole number"),
])
def test_a_value_of_the_wrong_kind_or_range_is_refused_before_loading(tmp_path, changes, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(")) as err:
        pipelines.load(_copy(tmp_path, **changes))
    assert "\n" not in str(err.value) and "fix the field" in str(err.value)


def test_a_config_that_is_not_a_mapping_is_refused(tmp_path):
    folder = _copy(tmp_path)
    (folder / "vae" / "config.json").write_text("[1, 2]")
    with pytest.raises(UserError, match="vae/config.json holds a JSON list, not a mapping of settings"):
        pipelines.load(folder)


@pytest.mark.parametrize("changes,weight", [
    ({"joint_attention_dim": 64}, "context_embedder.weight is [128, 128] in the weights but the config builds [128, 64]"),
    ({"num_attention_heads": 8}, "in the weights but the config builds"),
])
def test_sizes_that_do_not_match_the_weights_name_the_component(tmp_path, changes, weight):
    with pytest.raises(UserError, match="transformer/config.json does not match the weights beside it") as err:
        pipelines.load(_copy(tmp_path, **changes))
    assert weight in str(err.value) and "\n" not in str(err.value)


def test_sample_with_a_wrong_shape_config_prints_one_error_line(tmp_path, capsys):
    folder = _copy(tmp_path, joint_attention_dim=64)
    rc = main(["sample", "--model", str(folder), "--prompt", "a red circle", "--steps", "2",
               "--out", str(tmp_path / "out.png")])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err and not (tmp_path / "out.png").exists()
    assert [line for line in err.splitlines() if line.startswith("error:")] == [
        f"error: model folder {folder}: transformer/config.json does not match the weights beside it "
        "(context_embedder.weight is [128, 128] in the weights but the config builds [128, 64]); restore "
        "transformer/config.json from the original download"]


def test_ids_may_be_zero_or_negative_and_counts_of_zero_default_may_be_zero():
    class Config:
        def __init__(self, num_layers: int = 4, pad_token_id: int = 1, dropout_layers: int = 0, eps: float = 1e-6):
            pass

    check_settings({"num_layers": 1, "pad_token_id": -1, "dropout_layers": 0, "eps": 0.0}, Config, "x")
    with pytest.raises(UserError, match="dropout_layers=-1 must be between 0 and"):
        check_settings({"dropout_layers": -1}, Config, "x")
    with pytest.raises(UserError, match='eps="small" must be a finite number'):
        check_settings({"eps": "small"}, Config, "x")
    with pytest.raises(UserError, match="num_layers=0 must be between 1 and"):
        check_settings({"num_layers": 0}, Config, "x")
