"""scripts/export_run.py: a run's weights as the model folder the next stage starts from (a LoRA fused,
a full fine-tune loaded), which samples as the trained policy did."""

import json

import torch

import pipelines
from tests.scripts import load_script

export_run = load_script("export_run")
LORA = {"rank": 4, "alpha": 8, "blocks": "last:1"}


def velocity(policy):
    cond = policy.encode(["restore a sharp high resolution image"], images=[torch.full((3, 16, 16), 0.4)])
    x = policy.initial_noise(1, torch.Generator().manual_seed(0))
    with torch.no_grad():
        return policy.velocity(x, 0.6, cond, 1.0)


def test_a_shallow_lora_is_fused_into_a_folder_that_samples_as_the_trained_policy(tiny_model_dir, tmp_path):
    base = tiny_model_dir("kontext")
    trained = pipelines.load(base, lora=LORA)
    with torch.no_grad():
        for p in trained.transformer.parameters():
            if p.requires_grad:
                p.add_(0.2 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    trained.save_adapter(tmp_path / "adapter")
    before = velocity(pipelines.load(base))
    export_run.main(["--model", str(base), "--run", str(tmp_path / "adapter"), "--out", str(tmp_path / "next")])
    exported = pipelines.load(tmp_path / "next")
    assert not any("lora" in n for n, _ in exported.transformer.named_parameters())  # fused, no adapter left
    after = velocity(exported)
    assert torch.allclose(after, velocity(trained), atol=1e-4) and not torch.allclose(after, before, atol=1e-3)
    assert json.loads((tmp_path / "next" / "flowalign.json").read_text()) == json.loads((base / "flowalign.json").read_text())
    assert export_run.main(["--model", str(base), "--run", str(tmp_path / "adapter"), "--out", str(base)]) == 2
