"""``--adapter CKPT --ema``: a checkpoint's EMA weights load into a fresh policy exactly as training held them."""

from __future__ import annotations

import argparse

import pytest
import torch

from flowalign.cli.common import load_policy
from flowalign.errors import UserError
from flowalign.train import build_trainer
from tests.flowalign.trainers.conftest import prompt_file, small_config  # noqa: F401  (fixture)


def _args(model, adapter, ema: bool) -> argparse.Namespace:
    return argparse.Namespace(model=str(model), adapter=str(adapter) if adapter else None, device="cpu", dtype="fp32",
                              ema=ema)


@pytest.mark.parametrize("finetune", ["lora", "full"])
def test_ema_checkpoint_weights_load_by_name(tmp_path, tiny_sd3_dir, prompt_file, finetune):
    extra = ["trainer.ema_decay=0.5", "trainer.ema_every=1", "run.checkpoint_every=2", f"model.finetune={finetune}"]
    if finetune == "full":
        extra.append("trainer.beta=0")
    trainer = build_trainer(small_config(tmp_path / "run", tiny_sd3_dir, prompt_file, *extra))
    trainer.train()
    ckpt = tmp_path / "run" / "checkpoints" / "step-000002"
    with trainer.ema.swapped_in():
        expected = {n: p.detach().clone() for n, p in trainer.trainable_state().items()}
    live = {n: p.detach().clone() for n, p in trainer.trainable_state().items()}
    assert any(not torch.equal(expected[n], live[n]) for n in live)  # EMA and live weights differ

    ema_policy = load_policy(_args(tiny_sd3_dir, ckpt, ema=True))
    got = dict(ema_policy.trainable.named_parameters())
    for name, value in expected.items():
        torch.testing.assert_close(got[name].detach(), value, atol=0, rtol=0)
    live_policy = load_policy(_args(tiny_sd3_dir, ckpt, ema=False))
    got = dict(live_policy.trainable.named_parameters())
    for name, value in live.items():
        torch.testing.assert_close(got[name].detach(), value, atol=0, rtol=0)


def test_ema_without_checkpoint_or_shadow_is_refused(tmp_path, tiny_sd3_dir, prompt_file):
    with pytest.raises(UserError, match="--ema needs --adapter"):
        load_policy(_args(tiny_sd3_dir, None, ema=True))
    trainer = build_trainer(small_config(tmp_path / "run", tiny_sd3_dir, prompt_file, "run.checkpoint_every=2"))
    trainer.train()
    with pytest.raises(UserError, match="no ema.safetensors"):
        load_policy(_args(tiny_sd3_dir, tmp_path / "run" / "checkpoints" / "step-000002", ema=True))


@pytest.mark.parametrize("finetune", ["lora", "full"])
def test_a_self_distillation_checkpoint_loads_its_theta_not_phi(tmp_path, tiny_sd3_dir, prompt_file, finetune):
    """NFT/OPSD checkpoints hold the behaviour weights φ beside θ (``behaviour.*``) for resume; ``--adapter``
    loads θ and its EMA, and ignores φ."""
    extra = ["trainer.name=diffusion_nft", "trainer.timestep_fraction=0.25", "trainer.ema_decay=0.5",
             "trainer.ema_every=1", "run.checkpoint_every=2", f"model.finetune={finetune}"]
    trainer = build_trainer(small_config(tmp_path / "run", tiny_sd3_dir, prompt_file, *extra))
    trainer.train()
    ckpt = tmp_path / "run" / "checkpoints" / "step-000002"
    theta = {n: p.detach().clone() for n, p in trainer.policy.trainable.named_parameters() if p.requires_grad}
    phi = dict(zip(theta, trainer.behaviour.tensors))
    assert any(not torch.equal(theta[n], phi[n]) for n in theta)  # φ trails θ: loading φ would be caught
    with trainer.ema.swapped_in():
        ema = {n: p.detach().clone() for n, p in trainer.policy.trainable.named_parameters() if p.requires_grad}
    for use_ema, expected in ((False, theta), (True, ema)):
        got = dict(load_policy(_args(tiny_sd3_dir, ckpt, ema=use_ema)).trainable.named_parameters())
        for name, value in expected.items():
            torch.testing.assert_close(got[name].detach(), value, atol=0, rtol=0)
