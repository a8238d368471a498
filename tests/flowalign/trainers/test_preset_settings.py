"""A trainer's config holds only the settings its hooks read: a Flow-GRPO preset that places its own SDE
steps, or never samples with CPS, has no setting of those, and a config that gives one is refused, naming
the setting and the trainer (flow_grpo, which reads them all, takes the same keys)."""

import pytest
import torch

from flowalign.config import load_config
from flowalign.errors import UserError
from flowalign.plan import settings
from flowalign.train import build_trainer
from flowalign.trainers import trainer_config

from .conftest import REPO, small_config

#: (trainer, a setting of flow_grpo it does not read, a value flow_grpo takes)
NOT_READ = [
    ("mix_grpo", "sde_window", 2),  # the window is mix_grpo's own
    ("mix_grpo", "sde_last_step", False),
    ("mix_grpo", "timestep_fraction", 0.5),  # every window step is trained
    ("grpo_guard", "cps_log_prob", "gaussian"),  # its sampler is Flow-GRPO's SDE only
    ("gardo", "cps_log_prob", "gaussian"),
    ("gardo", "reference_offload", True),  # its reference is its own snapshot, not the starting weights
    ("flash_grpo", "sampler", "cps"),  # its step is its own: noise σ_1·σ_k at one step k_c, the step trained
    ("flash_grpo", "noise_level", 0.7),
    ("flash_grpo", "sde_window", 2),
    ("flash_grpo", "timestep_fraction", 0.5),
    ("flash_grpo", "steps_per_chunk", 1),
    ("dgpo", "updates_per_epoch", 2),  # its optimiser steps are step_per's
]


@pytest.mark.parametrize("name,key,value", NOT_READ, ids=lambda x: str(x))
def test_a_setting_the_trainer_does_not_read_is_refused_naming_it(name, key, value):
    with pytest.raises(UserError, match=rf"trainer\.{key}: {name} has no such setting"):
        trainer_config({"name": name, key: value})
    taker = "awm" if name == "dgpo" else "flow_grpo"
    _, tcfg = trainer_config({"name": taker, key: value})
    assert getattr(tcfg, key) == value


@pytest.mark.parametrize("beta", [0.04, 0.0])
def test_the_plan_counts_gardos_snapshot(beta):
    """One snapshot of the trained weights, with or without a KL term (GARDO keeps it either way)."""
    cfg = load_config(REPO / "configs/tiny/gardo_vvr.yaml", ["trainer.ema_decay=0", f"trainer.beta={beta}"])
    assert settings(cfg, "ddp", 1).extra_copies == 1


def test_gardos_snapshot_is_a_copy_of_the_trained_weights(tmp_path, tiny_sd3_dir, prompt_file):
    t = build_trainer(small_config(tmp_path / "g", tiny_sd3_dir, prompt_file, "trainer.name=gardo", "trainer.gate=false"))
    assert [r.shape for r in t.reference] == [p.shape for p in t.params]
    assert all(torch.equal(r, p) and r.data_ptr() != p.data_ptr() for r, p in zip(t.reference, t.params))
