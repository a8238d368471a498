"""LTX-2 policy on its tiny twin: one state holding the video and audio tokens, Gemma 3 + the text connectors,
CFG per stream, agreement with ``LTX2Pipeline`` (latents, video and waveform), and the published sizes on the
meta device."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from diffusers.pipelines.ltx2.pipeline_ltx2 import calculate_shift

import pipelines
from flowalign.errors import UserError
from flowalign.paths import REPO_ROOT
from flowalign.plan import build_on_meta
from flowalign.protocols import Conditioning, FlowPolicy
from tests.pipelines.family_checks import PROMPTS, ode

#: the pipeline's settings that switch off what the policy leaves out: STG, modality isolation, rescale
PLAIN_CFG = dict(stg_scale=0.0, audio_stg_scale=0.0, modality_scale=1.0, audio_modality_scale=1.0,
                 guidance_rescale=0.0, audio_guidance_rescale=0.0)


@pytest.fixture(scope="module")
def folder(tiny_model_dir):
    return tiny_model_dir("ltx2")


@pytest.fixture(scope="module")
def policy(folder):
    return pipelines.load(folder)


def pipe_kwargs(policy, steps: int) -> dict:
    d = policy.defaults
    return dict(height=d["height"], width=d["width"], num_frames=d["num_frames"], frame_rate=d["frame_rate"],
                num_inference_steps=steps, guidance_scale=d["guidance_scale"],
                audio_guidance_scale=d["audio_guidance_scale"], max_sequence_length=d["max_sequence_length"],
                **PLAIN_CFG)


def test_end_to_end_shapes_dtypes_range(policy):
    assert isinstance(policy, FlowPolicy) and policy.family == "ltx2" and policy.is_video
    cond = policy.encode(PROMPTS + ["a green star"])
    assert {f"negative_{k}" for k in ("prompt_embeds", "audio_prompt_embeds", "prompt_attention_mask")} <= set(cond.tensors)
    x = policy.initial_noise(3, torch.Generator().manual_seed(0))
    # 9 frames at 24 fps, 32×32; tiny VAE: temporal ×2, spatial ×4 → 5·8·8 = 320 video tokens; audio:
    # round(9/24 · 16000/160/4) = 9 tokens; both 4 wide (2 audio channels × 2 latent mel bins)
    assert policy.video_grid == (5, 8, 8) and policy.audio_frames == 9
    assert x.shape == (3, *policy.latent_shape) == (3, 329, 4) and x.dtype == torch.float32
    x0 = ode(policy, x, cond, policy.sigmas(3), guidance=policy.defaults["guidance_scale"])
    with torch.no_grad():
        videos, audio = policy.decode(x0), policy.decode_audio(x0)
    assert videos.shape == (3, 9, 3, 32, 32) and videos.dtype == torch.float32 and torch.isfinite(videos).all()
    assert videos.min() >= 0 and videos.max() <= 1
    # stereo waveform: 9 audio latents × 4 (VAE) × hop 160 / 16 kHz mel frames, upsampled ×4 by the vocoder
    assert audio.shape[:2] == (3, 2) and audio.shape[2] > 100 and torch.isfinite(audio).all()
    assert audio.abs().max() <= 1  # the vocoder's final tanh


def test_decode_is_differentiable(policy):
    x0 = policy.initial_noise(1, torch.Generator().manual_seed(4)).requires_grad_(True)
    policy.decode(x0).mean().backward()
    video_grad, audio_grad = policy.split(x0.grad)
    assert video_grad.abs().sum() > 0 and audio_grad.abs().sum() == 0  # the video reads only the video tokens


def test_sigmas_are_the_pipelines_own(policy):
    tokens = int(np.prod(policy.video_grid))
    for n in (2, 4, 10):
        ref = copy.deepcopy(policy.pipe.scheduler)
        config = ref.config
        mu = calculate_shift(tokens, config.base_image_seq_len, config.max_image_seq_len, config.base_shift,
                             config.max_shift)
        ref.set_timesteps(sigmas=np.linspace(1.0, 1 / n, n), mu=mu)
        grid = policy.sigmas(n)
        assert torch.equal(grid, ref.sigmas.float()) and grid[0] == 1 and grid[-1] == 0
    # the shift is dynamic and stretched to end at shift_terminal = 0.1 before the final 0
    assert torch.isclose(policy.sigmas(4)[-2], torch.tensor(0.1))
    # one step cannot be stretched (the scheduler divides by zero): refused rather than a NaN grid
    with pytest.raises(UserError, match="num_steps=1"):
        policy.sigmas(1)


def test_cfg_is_the_manual_combination_per_stream(policy):
    cond = policy.encode(PROMPTS)
    x = policy.initial_noise(2, torch.Generator().manual_seed(2))
    w, w_audio = 4.0, policy.defaults["audio_guidance_scale"]
    assert w_audio != w  # the tiny model's defaults use separate scales, as the pipeline's do
    with torch.no_grad():
        v = policy.velocity(x, 0.7, cond, w)
        v_c = policy.velocity(x, 0.7, cond, 1.0)
        v_u = policy.unconditional_velocity(x, 0.7, cond)
        empty = policy.velocity(x, 0.7, policy.encode(["", ""]), 1.0)
    assert not torch.allclose(v_c, v_u)
    (video, audio), (u_video, u_audio), (c_video, c_audio) = policy.split(v), policy.split(v_u), policy.split(v_c)
    torch.testing.assert_close(video, u_video + w * (c_video - u_video), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(audio, u_audio + w_audio * (c_audio - u_audio), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(v_u, empty)
    torch.testing.assert_close(policy.velocity(x, 0.7, cond, w, uncond=v_u), v, rtol=1e-5, atol=1e-5)


def test_ode_rollout_reproduces_the_diffusers_pipeline(policy):
    """Our noise, Euler steps over our grid, batched CFG and decodes against ``pipe(...)`` from the same seed
    (the pipeline mixes CFG in x0 space: equal up to float reassociation). Measured: latents agree to ~2e-6."""
    steps = 3
    x1 = policy.initial_noise(2, torch.Generator().manual_seed(7))
    ours = ode(policy, x1, policy.encode(PROMPTS), policy.sigmas(steps), policy.defaults["guidance_scale"])
    kwargs = pipe_kwargs(policy, steps)
    with torch.no_grad():
        latent = policy.pipe(prompt=PROMPTS, **kwargs, output_type="latent", generator=torch.Generator().manual_seed(7))
        decoded = policy.pipe(prompt=PROMPTS, **kwargs, output_type="pt", generator=torch.Generator().manual_seed(7))
        video, audio = policy.decode(ours), policy.decode_audio(ours)
    torch.testing.assert_close(policy.video_latents(ours), latent.frames, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(policy.audio_latents(ours), latent.audio, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(video, decoded.frames, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(audio, decoded.audio.float(), rtol=1e-4, atol=1e-4)


def test_the_audio_stream_is_denoised_jointly_with_the_video(policy):
    """The audio tokens change the video's velocity (audio→video cross-attention) and vice versa: the two
    streams cannot be rolled out separately."""
    cond = policy.encode(PROMPTS[:1])
    x = policy.initial_noise(1, torch.Generator().manual_seed(5))
    other = x.clone()
    other[:, int(np.prod(policy.video_grid)):] += 1.0  # move the audio tokens only
    with torch.no_grad():
        v, v_other = policy.velocity(x, 0.5, cond, 1.0), policy.velocity(other, 0.5, cond, 1.0)
    assert not torch.allclose(policy.split(v)[0], policy.split(v_other)[0])


def test_bad_num_frames_is_a_user_error(folder):
    with pytest.raises(UserError, match="num_frames=8: num_frames - 1 must be a multiple of 2"):
        pipelines.load(folder, defaults={"num_frames": 8})


def test_bad_height_is_a_user_error(folder):
    with pytest.raises(UserError, match="height=48 must be a multiple of 32"):
        pipelines.load(folder, defaults={"height": 48})


def test_published_sizes_on_the_meta_device():
    models = build_on_meta(REPO_ROOT / "assets" / "architectures" / "ltx-2")
    count = {k: sum(p.numel() for p in m.parameters()) for k, m in models.items()}
    # "ltx-2-19b": the audio-video transformer, 18.88B here; diffusers keeps the text connectors (a further
    # 1.43B) in their own component
    assert abs(count["transformer"] - 19e9) / 19e9 < 0.02, count["transformer"]
    assert abs(count["text_encoder"] - 12.2e9) / 12.2e9 < 0.02, count["text_encoder"]  # Gemma-3-12B (with SigLIP)


def test_the_conditioning_is_a_plain_mapping_of_tensors(policy):
    cond = policy.encode(PROMPTS)
    assert isinstance(cond, Conditioning) and all(isinstance(v, torch.Tensor) for v in cond.tensors.values())
    assert len(cond[[1]]) == 1
