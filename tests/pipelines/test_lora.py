"""LoRA through peft on every family: what trains, what stays frozen, reference passes, and the adapter file
round trip through diffusers' own ``load_lora_weights``."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

import pipelines
from pipelines import lora as lora_utils
from flowalign.errors import UserError

LORA = {"rank": 4, "alpha": 8}
PROMPTS = ["exactly two red circles", "a blue square left of a green triangle"]


def base_params(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p for n, p in module.named_parameters() if "lora_" not in n}


@pytest.fixture(scope="module", params=["sd3", "flux", "wan"])
def trained(request, tiny_model_dir):
    """A LoRA policy after one backward + AdamW step on a velocity loss, with what the tests inspect."""
    folder = tiny_model_dir(request.param)
    policy = pipelines.load(folder, lora=LORA)
    w = float(policy.defaults["guidance_scale"])
    cond = policy.encode(PROMPTS)
    x = policy.initial_noise(2, torch.Generator().manual_seed(0))
    before = {n: p.detach().clone() for n, p in base_params(policy.transformer).items()}
    with torch.no_grad():
        v_init = policy.velocity(x, 0.6, cond, w)
    trainable = [p for p in policy.trainable.parameters() if p.requires_grad]
    optimiser = torch.optim.AdamW(trainable, lr=1e-2)
    policy.velocity(x, 0.6, cond, w).pow(2).mean().backward()
    grads = {n: (p.grad.clone() if p.grad is not None else None) for n, p in policy.transformer.named_parameters()}
    optimiser.step()
    with torch.no_grad():
        v_adapted = policy.velocity(x, 0.6, cond, w)
    return dict(
        folder=folder, policy=policy, cond=cond, x=x, w=w, before=before, grads=grads,
        v_init=v_init, v_adapted=v_adapted,
    )


def test_only_adapter_tensors_get_gradients(trained):
    policy, grads = trained["policy"], trained["grads"]
    trainable = {n for n, p in policy.trainable.named_parameters() if p.requires_grad}
    assert trainable and all("lora_A" in n or "lora_B" in n for n in trainable)
    assert all(p.dtype == torch.float32 for p in policy.trainable.parameters() if p.requires_grad)
    assert all(g is None for n, g in grads.items() if "lora_" not in n), "base weights must get no gradient"
    # lora_B starts at zero, so the first gradient lands on B (A's gradient is B^T·… = 0)
    assert any(g is not None and g.abs().sum() > 0 for n, g in grads.items() if "lora_B" in n)
    for name, module in policy.pipe.components.items():
        if isinstance(module, torch.nn.Module) and module is not policy.transformer:
            assert all(p.grad is None for p in module.parameters()), name


def test_fresh_adapter_is_the_identity_and_the_step_moves_it(trained):
    base = pipelines.load(trained["folder"])
    with torch.no_grad():
        v_base = base.velocity(trained["x"], 0.6, trained["cond"], trained["w"])
    torch.testing.assert_close(trained["v_init"], v_base, rtol=0, atol=1e-6)
    assert not torch.allclose(trained["v_adapted"], v_base, atol=1e-4)


def test_base_weights_bit_identical_after_an_optimizer_step(trained):
    after = base_params(trained["policy"].transformer)
    assert after.keys() == trained["before"].keys()
    assert all(torch.equal(after[n], trained["before"][n]) for n in after)


def test_adapter_disabled_is_the_base_model(trained):
    policy = trained["policy"]
    flags = [p.requires_grad for p in policy.transformer.parameters()]
    fresh = pipelines.load(trained["folder"])
    with torch.no_grad():
        with policy.adapter_disabled():
            v_off = policy.velocity(trained["x"], 0.6, trained["cond"], trained["w"])
        v_base = fresh.velocity(trained["x"], 0.6, trained["cond"], trained["w"])
        v_on = policy.velocity(trained["x"], 0.6, trained["cond"], trained["w"])
    torch.testing.assert_close(v_off, v_base, rtol=0, atol=1e-6)
    torch.testing.assert_close(v_on, trained["v_adapted"], rtol=0, atol=1e-6)
    assert [p.requires_grad for p in policy.transformer.parameters()] == flags, "requires_grad restored"


def test_adapter_disabled_restores_each_layer_as_it_was(trained):
    """Leaving the context switches back on only the layers it switched off: a layer the caller had
    switched off stays off, and no adapter tensor's requires_grad changes, inside or after."""
    policy = trained["policy"]
    layers, _ = lora_utils.tuner_layers(policy.transformer)
    flags = [p.requires_grad for p in policy.transformer.parameters()]
    layers[0].enable_adapters(False)  # the caller's own switch (peft's API), before the context
    flags_off = [p.requires_grad for p in policy.transformer.parameters()]
    try:
        with policy.adapter_disabled():
            assert all(layer.disable_adapters for layer in layers)
            assert [p.requires_grad for p in policy.transformer.parameters()] == flags_off
        assert layers[0].disable_adapters and not any(layer.disable_adapters for layer in layers[1:])
        assert [p.requires_grad for p in policy.transformer.parameters()] == flags_off
    finally:
        layers[0].enable_adapters(True)
    assert [p.requires_grad for p in policy.transformer.parameters()] == flags


def test_adapter_disabled_finds_an_adapter_loaded_after_first_use(trained, tmp_path):
    """The LoRA layers are remembered between calls; an adapter loaded into a frozen policy afterwards is
    found (its outputs switch off to the base model's) and stays frozen."""
    trained["policy"].save_adapter(tmp_path / "adapter")
    frozen = pipelines.load(trained["folder"])
    x, cond, w = trained["x"], trained["cond"], trained["w"]
    with pytest.raises(UserError, match="reference"):
        with frozen.adapter_disabled():
            pass
    assert lora_utils.tuner_layers(frozen.transformer) == ([], [])  # remembered: no LoRA layers yet
    with torch.no_grad():
        v_base = frozen.velocity(x, 0.6, cond, w)
        frozen.load_adapter(tmp_path / "adapter")
        with frozen.adapter_disabled():
            v_off = frozen.velocity(x, 0.6, cond, w)
        v_on = frozen.velocity(x, 0.6, cond, w)
    torch.testing.assert_close(v_off, v_base, rtol=0, atol=0)
    torch.testing.assert_close(v_on, trained["v_adapted"], rtol=0, atol=1e-5)
    assert not any(p.requires_grad for p in frozen.transformer.parameters())


def test_saved_adapter_loads_with_diffusers_load_lora_weights(trained, tmp_path):
    policy = trained["policy"]
    policy.save_adapter(tmp_path / "adapter")
    file = tmp_path / "adapter" / "pytorch_lora_weights.safetensors"
    with safe_open(str(file), "pt") as f:
        keys = list(f.keys())
    assert keys and all(k.startswith("transformer.") and "lora_" in k for k in keys)
    fresh = pipelines.load(trained["folder"])
    fresh.pipe.load_lora_weights(str(tmp_path / "adapter"))  # exactly what a diffusers user runs
    with torch.no_grad():
        v = fresh.velocity(trained["x"], 0.6, trained["cond"], trained["w"])
    torch.testing.assert_close(v, trained["v_adapted"], rtol=1e-5, atol=1e-5)


def test_load_adapter_from_a_checkpoint_folder(trained, tmp_path):
    checkpoint = tmp_path / "checkpoints" / "step-000100"
    trained["policy"].save_adapter(checkpoint)
    (checkpoint / "optimizer.pt").write_bytes(b"")  # a trainer checkpoint holds more than the adapter

    frozen = pipelines.load(trained["folder"])  # evaluation: a frozen policy gets the adapter
    frozen.load_adapter(checkpoint)
    assert not any(p.requires_grad for p in frozen.transformer.parameters())

    resumed = pipelines.load(trained["folder"], lora=LORA)  # resume: copied into the existing adapter
    params = {n: p for n, p in resumed.transformer.named_parameters() if p.requires_grad}
    resumed.load_adapter(checkpoint)
    assert {n: p for n, p in resumed.transformer.named_parameters() if p.requires_grad} == params

    with torch.no_grad():
        for policy in (frozen, resumed):
            v = policy.velocity(trained["x"], 0.6, trained["cond"], trained["w"])
            torch.testing.assert_close(v, trained["v_adapted"], rtol=1e-5, atol=1e-5)

    other_rank = pipelines.load(trained["folder"], lora={"rank": 2, "alpha": 8})
    with pytest.raises(UserError, match="rank/alpha"):
        other_rank.load_adapter(checkpoint)


def test_default_targets_cover_the_attention_projections(tiny_sd3_dir):
    policy = pipelines.load(tiny_sd3_dir, lora=LORA)
    wrapped = {n.rsplit(".", 1)[-1] if not n.endswith("to_out.0") else "to_out.0"
               for n, m in policy.transformer.named_modules() if hasattr(m, "lora_A")}
    assert wrapped == {"to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"}
    custom = pipelines.load(tiny_sd3_dir, lora={**LORA, "target_modules": ["to_q"]})
    assert {n.rsplit(".", 1)[-1] for n, m in custom.transformer.named_modules() if hasattr(m, "lora_A")} == {"to_q"}


def test_full_finetune_trains_every_transformer_weight(tiny_sd3_dir):
    policy = pipelines.load(tiny_sd3_dir, full_finetune=True)
    assert all(p.requires_grad for p in policy.trainable.parameters())
    assert not any(p.requires_grad for p in policy.vae.parameters())
    with pytest.raises(UserError, match="reference"):
        with policy.adapter_disabled():
            pass
    with pytest.raises(UserError, match="save_adapter"):
        policy.save_adapter("unused")


def test_lora_option_errors(tiny_sd3_dir):
    with pytest.raises(UserError, match="lora has unknown key"):
        pipelines.load(tiny_sd3_dir, lora={"rank": 4, "alpah": 8})
    with pytest.raises(UserError, match="lora and full_finetune"):
        pipelines.load(tiny_sd3_dir, lora=LORA, full_finetune=True)
    with pytest.raises(UserError, match="target_modules"):
        pipelines.load(tiny_sd3_dir, lora={"rank": 4, "target_modules": ["no_such_layer"]})


def test_gradient_checkpointing_and_bf16_adapter(tiny_sd3_dir):
    policy = pipelines.load(tiny_sd3_dir, dtype="bf16", lora=LORA, gradient_checkpointing=True)
    assert policy.transformer.is_gradient_checkpointing
    lora_params = [p for p in policy.trainable.parameters() if p.requires_grad]
    assert all(p.dtype == torch.float32 for p in lora_params), "adapter kept in fp32 under a bf16 model"
    policy.transformer.train()
    cond = policy.encode(PROMPTS[:1])
    policy.velocity(policy.initial_noise(1), 0.5, cond, 4.0).pow(2).mean().backward()
    assert any(p.grad is not None for p in lora_params)


def _adapted_forward(folder, compute_dtype: str) -> dict:
    """One bf16 velocity with a non-zero adapter (the same on every call) and its backward: the output, the
    adapter's gradient, its tensors' dtypes and what the forward saved for the backward."""
    torch.manual_seed(0)
    policy = pipelines.load(folder, dtype="bf16", lora={**LORA, "compute_dtype": compute_dtype})
    g = torch.Generator().manual_seed(1)
    adapter = [p for n, p in policy.transformer.named_parameters() if "lora_" in n]
    for n, p in policy.transformer.named_parameters():
        if "lora_B" in n:
            p.data = 0.1 * torch.randn(p.shape, generator=g)
    cond = policy.encode(PROMPTS[:1])
    saved: list[tuple[torch.dtype, tuple[int, ...]]] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append((t.dtype, tuple(t.shape))) or t, lambda t: t):
        v = policy.velocity(policy.initial_noise(1, torch.Generator().manual_seed(0)), 0.6, cond, 1.0)
    v.float().pow(2).mean().backward()
    widths = {m.in_features for m in policy.transformer.modules() if getattr(m, "lora_A", None)} | {LORA["rank"]}
    return dict(v=v, grad=torch.cat([p.grad.flatten() for p in adapter]), dtypes={p.dtype for p in adapter},
                grad_dtypes={p.grad.dtype for p in adapter},
                float32_activations=[s for d, s in saved if d == torch.float32 and len(s) == 2 and s[-1] in widths],
                state_keys=sorted(lora_utils.get_peft_model_state_dict(policy.transformer)))


def test_an_adapter_computing_in_the_model_dtype_keeps_float32_weights_and_no_float32_activations(tiny_sd3_dir):
    """``compute_dtype: model``: the bf16 model's adapters run in bf16 (no float32 copy of an adapted layer's
    input or of the adapter's product is saved for the backward; ``fp32``, peft's way, saves them) over float32
    weights that get float32 gradients; the output and the gradient are peft's float32 way's to bf16's
    precision, and the adapter's state dict is unchanged (it saves and loads as before)."""
    peft_way, model_dtype = _adapted_forward(tiny_sd3_dir, "fp32"), _adapted_forward(tiny_sd3_dir, "model")
    assert peft_way["float32_activations"] and not model_dtype["float32_activations"]
    assert model_dtype["dtypes"] == model_dtype["grad_dtypes"] == {torch.float32}
    v32, v16 = peft_way["v"].float(), model_dtype["v"].float()
    assert 0 < (v32 - v16).abs().max() <= 2 ** -6 * v32.abs().max()  # a rounding apart, not the same computation
    assert torch.nn.functional.cosine_similarity(peft_way["grad"], model_dtype["grad"], dim=0) > 0.999
    assert model_dtype["state_keys"] == peft_way["state_keys"]
    with pytest.raises(UserError, match="lora.compute_dtype"):
        pipelines.load(tiny_sd3_dir, lora={**LORA, "compute_dtype": "bf16"})
