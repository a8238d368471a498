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


def _lora_deltas(transformer) -> dict[str, torch.Tensor]:
    """``ΔW = (α/r)·B·A`` of every LoRA layer of a peft-wrapped transformer, by its base layer's name."""
    deltas = {}
    for name, module in transformer.named_modules():
        if hasattr(module, "lora_A") and "default" in getattr(module, "lora_A", {}):
            a, b = module.lora_A["default"].weight, module.lora_B["default"].weight
            deltas[name] = (module.scaling["default"] * b @ a).detach()
    return deltas


def test_several_lora_runs_merge_each_scaled_and_a_full_fine_tune_is_refused(tiny_model_dir, tmp_path):
    """``--run A --run B --scale 1 0.8``: every adapted weight of the folder is W + ΔW_A + 0.8·ΔW_B (AR-CoPO's final
    model), the deltas computed from each adapter's own A and B; a --scale count that does not match is refused."""
    base = tiny_model_dir("kontext")
    deltas = []
    for i, name in enumerate(("a", "b")):
        trained = pipelines.load(base, lora=LORA)
        with torch.no_grad():
            for p in trained.transformer.parameters():
                if p.requires_grad:
                    p.add_(0.2 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel() + i)))
        trained.save_adapter(tmp_path / name)
        deltas.append(_lora_deltas(trained.transformer))
    assert deltas[0] and deltas[0].keys() == deltas[1].keys()
    weights = dict(pipelines.load(base).transformer.named_parameters())
    assert export_run.main(["--model", str(base), "--run", str(tmp_path / "a"), "--run", str(tmp_path / "b"),
                            "--scale", "1", "0.8", "--out", str(tmp_path / "merged")]) == 0
    merged = dict(pipelines.load(tmp_path / "merged").transformer.named_parameters())
    for layer, delta in deltas[0].items():
        key = layer.replace(".base_layer", "") + ".weight"
        expected = weights[key] + delta + 0.8 * deltas[1][layer]
        torch.testing.assert_close(merged[key], expected, atol=1e-6, rtol=1e-5)
    untouched = [k for k in weights if not any(k == layer + ".weight" for layer in deltas[0])]
    assert untouched and all(torch.equal(merged[k], weights[k]) for k in untouched)
    assert export_run.main(["--model", str(base), "--run", str(tmp_path / "a"), "--run", str(tmp_path / "b"),
                            "--scale", "1", "--out", str(tmp_path / "bad")]) == 2
