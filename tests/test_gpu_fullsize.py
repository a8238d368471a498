"""scripts/gpu_fullsize.py: the architectures it times are the released ones, and its whole path (build, save,
load through the recipe, one optimiser step, final evaluation) runs, shrunk, on CPU."""

import json

import pytest
import torch

from pipelines.tiny import build_tiny
from tests.scripts import load_script

fullsize = load_script("gpu_fullsize")

# parameter counts of the released checkpoints (billions), as diffusers / transformers load them
RELEASED = {
    "sd3": {"transformer": 2.243, "text_encoder": 0.124, "text_encoder_2": 0.695, "text_encoder_3": 4.762, "vae": 0.084},
    "flux": {"transformer": 11.901, "text_encoder": 0.123, "text_encoder_2": 4.762, "vae": 0.084},
    "wan": {"transformer": 1.419, "text_encoder": 5.681, "vae": 0.127},
}


@pytest.mark.parametrize("family", ["sd3", "flux", "wan"])
def test_published_architectures_have_the_released_sizes(family):
    with torch.device("meta"):  # shapes only: no memory, no init
        pipe = build_tiny(family, **fullsize.published(family))
    sizes = {name: sum(p.numel() for p in m.parameters()) / 1e9 for name, m in pipe.components.items()
             if isinstance(m, torch.nn.Module)}
    assert sizes == pytest.approx(RELEASED[family], rel=0.01)


def test_smoke_run_times_a_real_update_and_writes_its_json(tmp_path):
    out = tmp_path / "fullsize.json"
    rc = fullsize.main(["--smoke", "--families", "sd3", "--workdir", str(tmp_path / "work"), "--out", str(out)])
    row = json.loads(out.read_text())["families"]["sd3"]
    assert rc == 0 and "error" not in row, row
    assert row["update_s"] > 0.01  # the update ran (a group of equal rewards would have skipped it)
    assert row["zero_adv_fraction"] < 1 and row["grad_norm"] > 0  # and it had a gradient to apply
    assert row["step_s"] >= row["sample_s"] + row["update_s"] and row["final_eval_s"] > 0
    assert not (tmp_path / "work" / "sd3-model").exists()  # one model folder on disk at a time
