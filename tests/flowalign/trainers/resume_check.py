"""A registered trainer trains for 2 steps and a run stopped after step 1 and resumed ends at the same weights."""

from __future__ import annotations

from pathlib import Path

import torch

from flowalign.train import build_trainer

from .conftest import small_config


def trainer(run_dir: Path, model: Path, prompts: Path, *extra: str):
    torch.manual_seed(0)  # the adapter's initialisation
    return build_trainer(small_config(run_dir, model, prompts, "run.checkpoint_every=1", *extra))


def assert_trains_and_resumes_bit_exactly(tmp_path: Path, model: Path, prompts: Path, *extra: str):
    """Two steps straight vs one step, then a new trainer resumed from its checkpoint for the second."""
    straight = trainer(tmp_path / "straight", model, prompts, *extra)
    start = {k: v.detach().clone() for k, v in straight.trainable_state().items()}
    straight.train()
    trainer(tmp_path / "cut", model, prompts, "trainer.max_steps=1", *extra).train()
    resumed = trainer(tmp_path / "cut", model, prompts, *extra)
    resumed.train()
    a, b = straight.trainable_state(), resumed.trainable_state()
    assert straight.step == resumed.step == 2 and a.keys() == b.keys()
    assert any(not torch.equal(a[k], start[k]) for k in a)  # it trained
    assert all(torch.equal(a[k], b[k]) for k in a)
    return straight
