"""Wan policy on the tiny Wan 2.1-like model: video latents, CFG, VAE de-normalisation, agreement with
``WanPipeline``, and the UniPC scheduler real checkpoints ship."""

from __future__ import annotations

import copy
import json
import shutil

import pytest
import torch
from diffusers import UniPCMultistepScheduler

import pipelines
from flowalign.errors import UserError
from flowalign.protocols import FlowPolicy
from tests.pipelines.family_checks import (PROMPTS, check_cfg_is_the_manual_combination,
                                           check_rollout_reproduces_pipeline,
                                           check_velocity_with_a_given_uncond, ode)


@pytest.fixture(scope="module")
def policy(tiny_wan_dir):
    return pipelines.load(tiny_wan_dir)


def test_end_to_end_shapes_dtypes_range(policy):
    assert isinstance(policy, FlowPolicy)
    assert policy.family == "wan" and policy.is_video
    assert policy.vae.dtype == torch.float32
    cond = policy.encode(PROMPTS)
    assert set(cond.tensors) == {"prompt_embeds", "negative_prompt_embeds"}
    x = policy.initial_noise(2, torch.Generator().manual_seed(0))
    # 5 frames, 32×32; tiny VAE: temporal factor 2, spatial 4 → (4 ch, 3 latent frames, 8, 8)
    assert x.shape == (2, *policy.latent_shape) == (2, 4, 3, 8, 8) and x.dtype == torch.float32
    x0 = ode(policy, x, cond, policy.sigmas(3), guidance=policy.defaults["guidance_scale"])
    assert torch.isfinite(x0).all()
    with torch.no_grad():
        videos = policy.decode(x0)
    assert videos.shape == (2, 5, 3, 32, 32) and videos.dtype == torch.float32
    assert torch.isfinite(videos).all() and videos.min() >= 0 and videos.max() <= 1


def test_sigmas_are_the_schedulers_own(policy):
    for n in (1, 4, 10):
        ref = copy.deepcopy(policy.pipe.scheduler)
        ref.set_timesteps(n)
        assert torch.equal(policy.sigmas(n), ref.sigmas.float())


def test_transformer_output_is_the_velocity_of_the_convention(policy):
    cond = policy.encode(PROMPTS)
    x = policy.initial_noise(2, torch.Generator().manual_seed(1))
    grid = policy.sigmas(4)
    scheduler = copy.deepcopy(policy.scheduler)
    with torch.no_grad():
        v = policy.velocity(x, grid[0], cond, 1.0)
    stepped = scheduler.step(v, scheduler.timesteps[0], x, return_dict=False)[0]
    torch.testing.assert_close(stepped, x + (grid[1] - grid[0]) * v, rtol=0, atol=1e-6)


def test_cfg_is_the_manual_combination(policy):
    check_cfg_is_the_manual_combination(policy, 5.0)


def test_ode_rollout_reproduces_the_diffusers_pipeline(policy):
    x1 = policy.initial_noise(2, torch.Generator().manual_seed(7))
    steps, w = 3, 5.0
    ours = ode(policy, x1, policy.encode(PROMPTS), policy.sigmas(steps), w)
    # the pipeline runs cond and uncond as two passes, we batch them: equal up to float reassociation
    check_rollout_reproduces_pipeline(policy, x1, ours, latent_tol=1e-4, pixel_tol=1e-3, prompt=PROMPTS, height=32,
                                      width=32, num_frames=5, num_inference_steps=steps, guidance_scale=w,
                                      max_sequence_length=policy.defaults["max_sequence_length"])


def test_decode_undoes_the_latent_normalisation(tiny_model_dir):
    """With non-trivial ``latents_mean/std`` the decode must apply z·std + mean (as WanPipeline does)."""
    mean, std = [0.1, -0.2, 0.3, 0.0], [0.5, 1.5, 1.0, 2.0]
    policy = pipelines.load(tiny_model_dir("wan", vae={"latents_mean": mean, "latents_std": std}))
    z = torch.randn(1, *policy.latent_shape, generator=torch.Generator().manual_seed(0))
    raw = z * torch.tensor(std).view(1, 4, 1, 1, 1) + torch.tensor(mean).view(1, 4, 1, 1, 1)
    with torch.no_grad():
        expected = (policy.vae.decode(raw, return_dict=False)[0] / 2 + 0.5).clamp(0, 1).permute(0, 2, 1, 3, 4)
        torch.testing.assert_close(policy.decode(z), expected)


def test_unipc_checkpoint_uses_its_own_sigma_grid(tiny_wan_dir, tmp_path):
    """Real Wan 2.1 folders ship UniPC with flow sigmas: the policy keeps UniPC's grid (1 → 0)."""
    folder = tmp_path / "wan-unipc"
    shutil.copytree(tiny_wan_dir, folder)
    shutil.rmtree(folder / "scheduler")
    unipc = UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=5.0, num_train_timesteps=1000
    )
    unipc.save_pretrained(folder / "scheduler")
    index = json.loads((folder / "model_index.json").read_text())
    index["scheduler"] = ["diffusers", "UniPCMultistepScheduler"]
    (folder / "model_index.json").write_text(json.dumps(index))
    (folder / "flowalign.json").unlink()  # as a downloaded checkpoint: no flowalign defaults

    policy = pipelines.load(folder, defaults={"height": 32, "width": 32, "num_frames": 5})
    assert policy.defaults["shift"] == 5.0 and policy.defaults["num_steps"] == 50
    for n in (4, 10):
        unipc.set_timesteps(n)
        grid = policy.sigmas(n)
        assert grid[0] == 1 and grid[-1] == 0 and (grid.diff() < 0).all()
        torch.testing.assert_close(grid, unipc.sigmas.float(), rtol=0, atol=2e-6)


def test_bad_num_frames_is_a_user_error(tiny_wan_dir):
    with pytest.raises(UserError, match="num_frames"):
        pipelines.load(tiny_wan_dir, defaults={"num_frames": 4})


def test_velocity_with_a_given_uncond_runs_the_conditional_half_only(policy):
    check_velocity_with_a_given_uncond(policy)
