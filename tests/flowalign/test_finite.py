"""Non-finite numbers: refused in configs; a diverging run stops before a checkpoint, naming step and quantity."""

import pytest
import torch

from flowalign import checkpoint as ckpt
from flowalign.config import load_config
from flowalign.errors import UserError
from flowalign.finite import check_training_finite, non_finite_key
from flowalign.train import build_trainer, train
from tests.flowalign.trainers.conftest import prompt_file, small_config  # noqa: F401 (a fixture)


@pytest.mark.parametrize("override,key", [
    ("trainer.lr=.inf", "trainer.lr"), ("trainer.lr=-.inf", "trainer.lr"), ("run.max_invalid_fraction=.nan", "run.max_invalid_fraction"),
    ("model.lora.alpha=.inf", "model.lora.alpha"), ("rewards=[{name: vvr, weight: .nan}]", "rewards[0].weight"),
    ("rewards=[{name: vvr, scale: [1, .inf]}]", "rewards[0].scale[1]"), ("model.defaults={guidance_scale: .nan}", "model.defaults.guidance_scale"),
])
def test_configs_refuse_non_finite_numbers(override, key):
    with pytest.raises(UserError, match="not a finite number") as err:
        load_config(None, [override])
    assert str(err.value).startswith(f"invalid config: {key}: ") and len(str(err.value).splitlines()) == 1


@pytest.mark.parametrize("override", ["eval.every=true", "run.seed=false", "model.lora.rank=true"])
def test_true_and_false_are_not_numbers(override):
    with pytest.raises(UserError, match=f"{override.split('=')[0]}: expected a number, not true/false"):
        load_config(None, [override])


@pytest.mark.parametrize("override", ["trainer.max_steps=true", "trainer.lr=false"])
def test_true_and_false_are_not_trainer_numbers(override, tmp_path, tiny_sd3_dir, prompt_file):
    with pytest.raises(UserError, match=f"{override.split('=')[0]}: expected a number, not true/false"):
        build_trainer(small_config(tmp_path / "r", tiny_sd3_dir, prompt_file, override))
    assert not (tmp_path / "r" / "config.yaml").exists()


def test_non_finite_helpers_name_the_first_bad_quantity(tmp_path):
    assert non_finite_key({"a": [1.0, {"b": 2.0}], "c": "inf"}) is None
    assert non_finite_key({"a": [1.0, {"b": float("nan")}]})[0] == "a[1].b"
    check_training_finite(3, {"train/loss": 0.5, "reward/x": float("nan")}, {"weight w": torch.ones(2)}, tmp_path)
    nan = float("nan")
    with pytest.raises(UserError, match=r"step 3: non-finite train/grad_norm \(nan\) after train/loss \(nan\).*no "
                                        r"checkpoint was written"):
        check_training_finite(3, {"train/loss": nan, "train/grad_norm": nan}, {"weight w": torch.ones(2)}, tmp_path)
    with pytest.raises(UserError, match="step 3: non-finite weight w"):
        check_training_finite(3, {"train/grad_norm": 1.0}, {"weight w": torch.tensor([1.0, float("inf")])}, tmp_path)


def test_a_diverging_run_stops_before_its_checkpoint_and_keeps_the_last_good_one(tmp_path, tiny_sd3_dir, prompt_file):
    # Adam moves every weight by about lr, and the LoRA output is scaled by alpha / rank (both at their
    # bounds): after one step it overflows fp16 and the samples are NaN
    run_dir = tmp_path / "r"
    with pytest.raises(UserError, match="step 2: non-finite sampled outputs") as err:
        train(small_config(run_dir, tiny_sd3_dir, prompt_file, "model.lora.alpha=1.0e6", "model.dtype=fp16", "trainer.lr=1",
                           "trainer.max_steps=4", "run.checkpoint_every=1"))
    assert "step-000001" in str(err.value) and len(str(err.value).splitlines()) == 1
    assert [p.name for p in ckpt.list_checkpoints(run_dir)] == ["step-000001"]
    assert not list((run_dir / "checkpoints").glob(".tmp-*"))
    state = ckpt.load_checkpoint(ckpt.latest_checkpoint(run_dir))["trainable"]
    assert all(torch.isfinite(t).all() for t in state.values())


def test_non_finite_weights_are_never_checkpointed(tmp_path, tiny_sd3_dir, prompt_file):
    trainer = build_trainer(small_config(tmp_path / "r", tiny_sd3_dir, prompt_file))
    with torch.no_grad():
        trainer.params[0][0].fill_(float("nan"))  # what a diverged update leaves behind
    with pytest.raises(UserError, match="step 0: non-finite weight"):
        trainer.save_checkpoint()
    assert ckpt.list_checkpoints(tmp_path / "r") == []
