"""Wan 2.2-A14B (two experts) on its tiny twin: the boundary switch between the high- and low-noise experts,
per-expert guidance, agreement with ``WanPipeline``, both experts trained (each with its own LoRA), and each
expert's LoRA file holding that expert's adapter."""

from __future__ import annotations

import pytest
import torch

import pipelines
from flowalign.protocols import FlowPolicy
from pipelines.wan22 import LORA_WEIGHT_NAME_2, Wan22Policy
from tests.pipelines import family_checks as checks

PROMPTS = checks.PROMPTS


@pytest.fixture(scope="module")
def folder(tiny_model_dir):
    return tiny_model_dir("wan22")


@pytest.fixture(scope="module")
def policy(folder):
    return pipelines.load(folder)


def count_calls(policy, fn):
    calls = {"high": [], "low": []}
    hooks = [policy.high_noise.register_forward_hook(lambda m, a, kw, o: calls["high"].append(kw["hidden_states"].shape[0]), with_kwargs=True),
             policy.transformer_2.register_forward_hook(lambda m, a, kw, o: calls["low"].append(kw["hidden_states"].shape[0]), with_kwargs=True)]
    try:
        with torch.no_grad():
            out = fn()
    finally:
        for h in hooks:
            h.remove()
    return out, calls


def test_loads_as_two_expert_wan(policy):
    assert isinstance(policy, Wan22Policy) and isinstance(policy, FlowPolicy)
    assert policy.family == "wan" and policy.is_video and policy.boundary == 875.0
    assert policy.transformer_2 is not policy.high_noise


def test_expert_switch_at_the_boundary_per_sample(policy):
    cond = policy.encode(PROMPTS)
    x = policy.initial_noise(2, torch.Generator().manual_seed(0))
    _, calls = count_calls(policy, lambda: policy.velocity(x, 0.9, cond, 1.0))
    assert calls == {"high": [2], "low": []}
    _, calls = count_calls(policy, lambda: policy.velocity(x, 0.875, cond, 1.0))
    assert calls == {"high": [2], "low": []}, "t == boundary is the high-noise expert's (t >= boundary)"
    _, calls = count_calls(policy, lambda: policy.velocity(x, 0.5, cond, 1.0))
    assert calls == {"high": [], "low": [2]}
    # a batch mixing σ's (training re-evaluation) routes each sample to its own expert
    mixed, calls = count_calls(policy, lambda: policy.velocity(x, torch.tensor([0.95, 0.3]), cond, 1.0))
    assert calls == {"high": [1], "low": [1]}
    with torch.no_grad():
        torch.testing.assert_close(mixed[:1], policy.velocity(x[:1], 0.95, cond[[0]], 1.0))
        torch.testing.assert_close(mixed[1:], policy.velocity(x[1:], 0.3, cond[[1]], 1.0))


def test_low_noise_expert_uses_guidance_scale_2(policy):
    cond = policy.encode(PROMPTS)
    x = policy.initial_noise(2, torch.Generator().manual_seed(1))
    assert policy.defaults["guidance_scale_2"] == 3.0
    with torch.no_grad():
        v4 = policy.velocity(x, 0.3, cond, 4.0)
        with policy._serving(policy.transformer_2):
            v3 = pipelines.wan.WanPolicy.velocity(policy, x, 0.3, cond, 3.0)
    torch.testing.assert_close(v4, v3)


def test_ode_rollout_reproduces_the_diffusers_pipeline(policy):
    x1 = policy.initial_noise(2, torch.Generator().manual_seed(7))
    steps = 6
    grid = policy.sigmas(steps)
    assert (grid[:-1] * 1000 >= 875).any() and (grid[:-1] * 1000 < 875).any(), "the grid must cross the boundary"
    ours = checks.ode(policy, x1, policy.encode(PROMPTS), grid, 4.0)
    kwargs = dict(prompt=PROMPTS, height=32, width=32, num_frames=5, num_inference_steps=steps, guidance_scale=4.0,
                  guidance_scale_2=3.0, max_sequence_length=32)
    with torch.no_grad():
        theirs = policy.pipe(**kwargs, latents=x1.clone(), output_type="latent").frames
    # the pipeline runs cond and uncond as two passes, we batch them: equal up to float reassociation
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("finetune", ["lora", "full"])
def test_both_experts_are_trained(folder, finetune):
    policy = pipelines.load(folder, **({"lora": checks.LORA} if finetune == "lora" else {"full_finetune": True}))
    names = {n.split(".")[0] for n, p in policy.trainable.named_parameters() if p.requires_grad}
    assert names == {"transformer", "transformer_2"}


def test_each_experts_lora_file_holds_that_experts_adapter(folder, tmp_path):
    """The saved adapter is two files, one per expert: read back, σ on either side of the boundary reproduces
    the trained policy's velocity, which differs from the base model's."""
    trained = checks.perturbed_lora_policy(folder)
    trained.save_adapter(tmp_path / "adapter")
    assert (tmp_path / "adapter" / LORA_WEIGHT_NAME_2).is_file()
    frozen = pipelines.load(folder)
    frozen.load_adapter(tmp_path / "adapter")
    cond = trained.encode(PROMPTS)
    x = trained.initial_noise(2, torch.Generator().manual_seed(3))
    with torch.no_grad():
        for sigma in (0.95, 0.3):
            torch.testing.assert_close(frozen.velocity(x, sigma, cond, 4.0), trained.velocity(x, sigma, cond, 4.0))
            with trained.adapter_disabled():
                assert not torch.allclose(trained.velocity(x, sigma, cond, 4.0), frozen.velocity(x, sigma, cond, 4.0))
