"""The loop's optimiser (flowalign/trainers/optim.py): AdamW with the kernels trainer.optimizer_kernel names."""

import torch

from flowalign.train import build_trainer

from .conftest import small_config


def trained(run_dir, tiny_sd3_dir, prompt_file, *extra):
    torch.manual_seed(0)
    trainer = build_trainer(small_config(run_dir, tiny_sd3_dir, prompt_file, "trainer.max_steps=1", *extra))
    before = [p.detach().clone() for p in trainer.params]
    trainer.train()
    return trainer, before


def test_the_fused_kernel_takes_the_steps_the_default_takes(tmp_path, tiny_sd3_dir, prompt_file):
    auto, start = trained(tmp_path / "auto", tiny_sd3_dir, prompt_file)
    fused, _ = trained(tmp_path / "fused", tiny_sd3_dir, prompt_file, "trainer.optimizer_kernel=fused")
    assert not auto.optimizer.param_groups[0]["fused"] and fused.optimizer.param_groups[0]["fused"]
    moved = max((a - s).abs().max().item() for a, s in zip(auto.params, start))
    apart = max((a - f).abs().max().item() for a, f in zip(auto.params, fused.params))
    assert moved > 1e-4  # the step at lr 1e-3 moved the weights
    assert apart < 1e-6 * moved, apart  # the same update, rounded differently (1e-10 here)
