"""pipelines.memory: transformer inputs per family, the attention backend switch, and gradient
checkpointing leaving gradients unchanged."""

from __future__ import annotations

import pytest
import torch

import pipelines
from flowalign.errors import UserError
from pipelines.memory import set_attention_backend, transformer_inputs


@pytest.mark.parametrize("family,frames", [("sd3", None), ("flux", None), ("wan", 5)])
def test_inputs_run_the_family_transformer_at_the_asked_size(tiny_model_dir, family, frames):
    policy = pipelines.load(tiny_model_dir(family))
    size = {"height": 64, "width": 48, "num_frames": frames, "max_sequence_length": 8}
    inputs = transformer_inputs(family, policy.transformer.config, 3, size, device="cpu")
    with torch.no_grad():
        out = policy.transformer(**inputs)[0]
    assert out.shape == inputs["hidden_states"].shape and out.shape[0] == 3
    if family == "flux":
        assert out.shape[1] == (64 // 16) * (48 // 16)  # packed 2x2 latent patches
    if family == "wan":
        assert out.shape[2] == 1 + (frames - 1) // 4  # the VAE's 4x time compression


def test_native_attention_changes_nothing(tiny_sd3_dir):
    policy = pipelines.load(tiny_sd3_dir)
    inputs = transformer_inputs("sd3", policy.transformer.config, 2, {"height": 32, "width": 32}, device="cpu")
    with torch.no_grad():
        before = policy.transformer(**inputs)[0]
        set_attention_backend(policy.transformer, "native", "cpu")
        assert torch.equal(before, policy.transformer(**inputs)[0])


def test_a_cuda_backend_off_cuda_or_without_its_package_is_a_one_line_error(tiny_sd3_dir):
    policy = pipelines.load(tiny_sd3_dir)
    with pytest.raises(UserError) as err:
        set_attention_backend(policy.transformer, "flash", "cpu")
    assert "model.attention_backend=flash" in str(err.value) and "CUDA" in str(err.value)
    from diffusers.models import attention_dispatch

    if attention_dispatch._CAN_USE_SAGE_ATTN:
        pytest.skip("sageattention is installed here")
    with pytest.raises(UserError) as err:
        set_attention_backend(policy.transformer, "sage", "cuda")  # the package check comes before any kernel runs
    message = str(err.value)
    assert "model.attention_backend=sage" in message and "sageattention" in message and "\n" not in message


def test_gradient_checkpointing_leaves_the_gradients_unchanged(tiny_sd3_dir):
    grads = []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        policy = pipelines.load(tiny_sd3_dir, full_finetune=True, gradient_checkpointing=checkpointing)
        policy.transformer.train()
        cond = policy.encode(["a red circle", "a blue square"])
        x = policy.initial_noise(2, torch.Generator().manual_seed(0))
        policy.velocity(x, 0.7, cond, 1.0).square().mean().backward()
        grads.append({n: p.grad.clone() for n, p in policy.transformer.named_parameters() if p.grad is not None})
    assert policy.transformer.is_gradient_checkpointing
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 10
    assert all(torch.allclose(grads[0][n], grads[1][n], rtol=1e-5, atol=1e-7) for n in grads[0])
    assert any(g.abs().sum() > 0 for g in grads[0].values())


def test_video_decodes_in_slices_of_decode_batch_size_with_the_same_pixels(tiny_wan_dir):
    whole = pipelines.load(tiny_wan_dir, decode_batch_size=4)
    sliced = pipelines.load(tiny_wan_dir, decode_batch_size=1)
    calls = {"whole": [], "sliced": []}
    for name, policy in (("whole", whole), ("sliced", sliced)):  # Wan's causal decoder runs once per latent frame
        policy.vae.decoder.register_forward_hook(lambda m, args, out, name=name: calls[name].append(args[0].shape[0]))
    x0 = whole.initial_noise(3, torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = whole.decode(x0), sliced.decode(x0)
    assert set(calls["whole"]) == {3} and set(calls["sliced"]) == {1}
    assert len(calls["sliced"]) == 3 * len(calls["whole"]) and a.shape == b.shape and a.shape[0] == 3
    assert torch.allclose(a, b, atol=1e-5)


def test_decode_batch_size_and_text_encoder_offload_reach_the_policy_from_the_config(tmp_path, tiny_wan_dir):
    from flowalign.config import load_config
    from flowalign.train import build_trainer

    prompts = tmp_path / "p.txt"
    prompts.write_text("a red circle\n")
    cfg = load_config(None, [f"model.path={tiny_wan_dir}", f"data.prompts={prompts}", "eval.bench=null",
                             f"run.output_dir={tmp_path / 'run'}", "run.tensorboard=false", "model.decode_batch_size=1",
                             "model.offload_text_encoders=true",
                             "rewards=[{name: 'tests.flowalign.trainers.toy_rewards:redness'}]"])
    policy = build_trainer(cfg).policy
    assert policy.options.decode_batch_size == 1
    assert all(p.device.type == "meta" for p in policy.pipe.text_encoder.parameters())


@pytest.mark.parametrize("family", ["sd3", "wan"])
def test_offloaded_text_encoders_leave_the_device_and_encode_the_same(tiny_model_dir, family):
    from pipelines.memory import offload_text_encoders

    folder = tiny_model_dir(family)
    reference = pipelines.load(folder).encode(["a red circle", "a blue square"])
    policy = pipelines.load(folder)
    names = offload_text_encoders(policy)
    assert names and all(n.startswith("text_encoder") for n in names)
    for name in names:  # nothing of the encoders stays on the device between uses
        assert all(p.device.type == "meta" for p in policy.pipe.components[name].parameters())
    out = policy.encode(["a red circle", "a blue square"])
    assert out.tensors.keys() == reference.tensors.keys()
    assert all(torch.equal(out.tensors[k], reference.tensors[k]) for k in out.tensors)


@pytest.mark.parametrize("family", ["sd3", "zimage"])
def test_load_applies_the_memory_options_to_every_family(tiny_model_dir, family):
    """Z-Image builds its policy without the shared PolicyOptions: load applies the options after it."""
    folder = tiny_model_dir(family)
    policy = pipelines.load(folder, offload_text_encoders=True)
    encoders = [m for n, m in policy.pipe.components.items() if n.startswith("text_encoder") and m is not None]
    assert encoders and all(p.device.type == "meta" for m in encoders for p in m.parameters())
    with pytest.raises(UserError, match="model.attention_backend=flash runs on CUDA"):
        pipelines.load(folder, attention_backend="flash")
    with pytest.raises(UserError, match="unknown option"):
        pipelines.load(folder, attention_backends="flash")


def test_the_processor_backend_names_are_the_ones_the_installed_diffusers_uses(tiny_wan_dir):
    """What diffusers' own ``set_attention_backend`` writes is what :func:`processor_backend` reads, and
    AnyFlow-FAR's causal processor (flex only, in diffusers) runs pinned to native without the class changing."""
    from diffusers.models.transformers.transformer_anyflow_far import AnyFlowCausalAttnProcessor

    from pipelines.memory import pin_processor_backend, processor_backend

    policy = pipelines.load(tiny_wan_dir)  # Wan's processors go through diffusers' dispatcher
    processors = [m.processor for m in policy.transformer.modules() if hasattr(m, "processor")]
    assert processors and {processor_backend(p) for p in processors} == {None}  # the active default
    policy.transformer.set_attention_backend("native")
    assert {processor_backend(p) for p in processors} == {"native"}

    flex_only, pinned = AnyFlowCausalAttnProcessor(), AnyFlowCausalAttnProcessor()
    assert processor_backend(flex_only) == "flex" and "native" not in flex_only._SUPPORTED_BACKENDS
    pin_processor_backend(pinned, "native")
    assert processor_backend(pinned) == "native" and "native" in pinned._SUPPORTED_BACKENDS
    assert "native" not in AnyFlowCausalAttnProcessor._SUPPORTED_BACKENDS  # the class keeps diffusers' list
    assert processor_backend(AnyFlowCausalAttnProcessor()) == "flex"


def _c_compiler() -> str | None:
    import shutil

    return next((c for c in ("cc", "gcc", "clang") if shutil.which(c)), None)


@pytest.mark.skipif(_c_compiler() is None, reason="torch.compile on a CPU needs a C compiler (cc, gcc or clang)")
def test_compiled_blocks_compute_what_the_eager_blocks_compute(tiny_model_dir):
    """``compile=True`` compiles each transformer block in place (the modules and their weights stay, so the
    adapter still trains and saves as before); a guided velocity and the adapter's gradient are the eager
    ones'. Two blocks, one of each kind SD3 has (the last one updates no text stream): compiling on a CPU
    takes a minute."""
    folder = tiny_model_dir("sd3", transformer={"num_layers": 2})

    def velocity_and_grad(compile: bool) -> tuple[torch.Tensor, torch.Tensor, object]:
        torch.manual_seed(0)
        policy = pipelines.load(folder, lora={"rank": 4, "alpha": 8}, compile=compile)
        for n, p in policy.transformer.named_parameters():
            if "lora_B" in n:
                p.data = 0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1))
        cond = policy.encode(["two red circles", "a blue square"])
        v = policy.velocity(policy.initial_noise(2, torch.Generator().manual_seed(0)), 0.6, cond, 4.5)
        v.pow(2).mean().backward()
        adapter = [p for n, p in policy.transformer.named_parameters() if "lora_" in n]
        return v.detach(), torch.cat([p.grad.flatten() for p in adapter]), policy

    eager_v, eager_g, _ = velocity_and_grad(False)
    v, g, policy = velocity_and_grad(True)
    from flowalign.parallel import block_modules

    blocks = block_modules(policy.transformer)
    assert len(blocks) == 2 and all(b._compiled_call_impl is not None for b in blocks)
    assert torch.allclose(v, eager_v, atol=1e-5) and torch.allclose(g, eager_g, rtol=1e-4, atol=1e-6)
