"""HunyuanVideo 1.5 policy on its tiny twin: video latents with the zero first-frame condition, both text
encoders, CFG, agreement with ``HunyuanVideo15Pipeline``, a saved LoRA read into an existing adapter, and the
published sizes on the meta device."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import pipelines
from flowalign.errors import UserError
from flowalign.plan import build_on_meta
from flowalign.paths import REPO_ROOT
from flowalign.protocols import Conditioning, FlowPolicy
from tests.pipelines.family_checks import LORA, PROMPTS, ode, perturbed_lora_policy


@pytest.fixture(scope="module")
def folder(tiny_model_dir):
    return tiny_model_dir("hunyuan_video15")


@pytest.fixture(scope="module")
def policy(folder):
    return pipelines.load(folder)


def test_end_to_end_shapes_dtypes_range(policy):
    assert isinstance(policy, FlowPolicy) and policy.family == "hunyuan_video15" and policy.is_video
    cond = policy.encode(PROMPTS + ['a sign that says "hello"'])
    assert {f"negative_{k}" for k in ("prompt_embeds", "prompt_embeds_2")} <= set(cond.tensors)
    # the quoted text reaches the ByT5 glyph encoder; prompts without quotes leave it zero
    assert cond.tensors["prompt_embeds_mask_2"][:2].sum() == 0 and cond.tensors["prompt_embeds_mask_2"][2].sum() > 0
    x = policy.initial_noise(3, torch.Generator().manual_seed(0))
    # 5 frames, 32×32; tiny VAE: temporal factor 2, spatial 4 → (4 ch, 3 latent frames, 8, 8)
    assert x.shape == (3, *policy.latent_shape) == (3, 4, 3, 8, 8)
    x0 = ode(policy, x, cond, policy.sigmas(3), guidance=policy.defaults["guidance_scale"])
    with torch.no_grad():
        videos = policy.decode(x0)
    assert videos.shape == (3, 5, 3, 32, 32) and torch.isfinite(videos).all()
    assert videos.min() >= 0 and videos.max() <= 1


def test_sigmas_are_the_pipelines_own(policy):
    for n in (1, 4, 10):
        ref = copy.deepcopy(policy.pipe.scheduler)
        ref.set_timesteps(sigmas=np.linspace(1.0, 0.0, n + 1)[:-1])
        grid = policy.sigmas(n)
        assert torch.equal(grid, ref.sigmas.float()) and grid[0] == 1 and grid[-1] == 0


def test_cfg_is_the_manual_combination(policy):
    cond = policy.encode(PROMPTS)
    x = policy.initial_noise(2, torch.Generator().manual_seed(2))
    with torch.no_grad():
        v = policy.velocity(x, 0.7, cond, 6.0)
        v_c = policy.velocity(x, 0.7, cond, 1.0)
        v_u = policy.unconditional_velocity(x, 0.7, cond)
        empty = policy.velocity(x, 0.7, policy.encode(["", ""]), 1.0)
    assert not torch.allclose(v_c, v_u)
    torch.testing.assert_close(v, v_u + 6.0 * (v_c - v_u), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(v_u, empty)
    torch.testing.assert_close(policy.velocity(x, 0.7, cond, 6.0, uncond=v_u), v, rtol=1e-5, atol=1e-5)


def test_ode_rollout_reproduces_the_diffusers_pipeline(policy):
    """Our Euler steps over the pipeline's grid, our batched CFG and decode against ``pipe(...)`` on the same
    noise (the pipeline's guider runs cond and uncond as two passes: equal up to float reassociation)."""
    x1 = policy.initial_noise(2, torch.Generator().manual_seed(7))
    steps = 3
    ours = ode(policy, x1, policy.encode(PROMPTS), policy.sigmas(steps), policy.defaults["guidance_scale"])
    kwargs = dict(height=32, width=32, num_frames=5, num_inference_steps=steps)
    with torch.no_grad():
        theirs = policy.pipe(prompt=PROMPTS, **kwargs, latents=x1.clone(), output_type="latent").frames
        # the pipeline's own decode, one video (its VAE mask does not broadcast over a batch)
        frames = policy.pipe(prompt=PROMPTS[:1], **kwargs, latents=x1[:1].clone(), output_type="pt").frames
        decoded = policy.decode(ours[:1])
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(decoded, frames, rtol=1e-3, atol=1e-3)


def test_bad_num_frames_is_a_user_error(folder):
    with pytest.raises(UserError, match="num_frames"):
        pipelines.load(folder, defaults={"num_frames": 4})


def test_published_sizes_on_the_meta_device():
    models = build_on_meta(REPO_ROOT / "assets" / "architectures" / "hunyuan-video-1.5-480p")
    count = {k: sum(p.numel() for p in m.parameters()) for k, m in models.items()}
    assert abs(count["transformer"] - 8.3e9) / 8.3e9 < 0.01  # "8.3 billion parameters"
    assert abs(count["text_encoder"] - 7.07e9) / 7.07e9 < 0.01  # Qwen2.5-VL-7B's language model


def test_the_conditioning_is_a_plain_mapping_of_tensors(policy):
    cond = policy.encode(PROMPTS)
    assert isinstance(cond, Conditioning) and all(isinstance(v, torch.Tensor) for v in cond.tensors.values())
    assert len(cond[[1]]) == 1


def test_the_saved_lora_loads_in_place_into_an_existing_adapter(folder, tmp_path):
    """A LoRA policy reading a saved adapter (a teacher, an evaluation) copies it into its own adapter."""
    trained = perturbed_lora_policy(folder)
    trained.save_adapter(tmp_path / "adapter")
    other = pipelines.load(folder, lora=LORA)
    params = [p for p in other.trainable.parameters() if p.requires_grad]
    other.load_adapter(tmp_path / "adapter")
    assert [p for p in other.trainable.parameters() if p.requires_grad] == params  # the same objects, trainable
    cond, x = trained.encode(PROMPTS), trained.initial_noise(2, torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(other.velocity(x, 0.5, cond, 1.0), trained.velocity(x, 0.5, cond, 1.0))
    with pytest.raises(UserError, match="rank/alpha"):
        pipelines.load(folder, lora={"rank": 2, "alpha": 8}).load_adapter(tmp_path / "adapter")


def test_plan_says_why_it_cannot_size_this_transformer_on_the_meta_device():
    """Its forward gathers tokens by boolean masks (value-dependent sizes): the planner refuses clearly."""
    from flowalign.config import load_config
    from flowalign.plan import plan_text

    folder = REPO_ROOT / "assets" / "architectures" / "hunyuan-video-1.5-480p"
    cfg = load_config(REPO_ROOT / "configs" / "wan2.1-1.3b" / "flow_grpo_motion.yaml", [f"model.path={folder}"])
    with pytest.raises(UserError, match="meta device: its forward depends on tensor values"):
        plan_text(cfg, folder, gpus=1, gpu_memory_gb=80)
