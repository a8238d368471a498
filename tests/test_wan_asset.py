"""The shipped tiny video model (assets/tiny-wan-motion) opens offline as a real Wan checkpoint does,
samples clips, rolls out with log-probs, and draws verifiable motion (it was trained, not just saved)."""

import json

import numpy as np
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline

import pipelines
from flowalign.evaluation import sample_seeded
from flowalign.paths import assets_dir
from flowalign.sampling import rollout
from rewards.vvr_motion import generate_tasks, verify

MODEL = assets_dir() / "tiny-wan-motion"
DEFAULTS = json.loads((MODEL / "flowalign.json").read_text())


def test_plain_diffusers_from_pretrained_samples_a_clip():
    pipe = WanPipeline.from_pretrained(MODEL)
    assert isinstance(pipe.scheduler, FlowMatchEulerDiscreteScheduler)
    pipe.set_progress_bar_config(disable=True)
    frames = pipe("a red circle moving to the right", num_inference_steps=3, height=DEFAULTS["height"],
                  width=DEFAULTS["width"], num_frames=DEFAULTS["num_frames"], guidance_scale=DEFAULTS["guidance_scale"],
                  max_sequence_length=DEFAULTS["max_sequence_length"], output_type="np",
                  generator=torch.Generator().manual_seed(0)).frames
    assert frames.shape == (1, DEFAULTS["num_frames"], DEFAULTS["height"], DEFAULTS["width"], 3)
    assert np.isfinite(frames).all()


def test_pipelines_load_picks_the_trained_sampling_defaults_and_rolls_out_with_log_probs():
    assert DEFAULTS["family"] == "wan" and DEFAULTS["num_frames"] == 9
    policy = pipelines.load(MODEL)
    assert policy.is_video
    for key in ("height", "width", "num_frames", "guidance_scale", "num_steps", "max_sequence_length", "shift"):
        assert policy.defaults[key] == DEFAULTS[key]
    out = rollout(policy, ["a blue square moving up", "a green star moving down"], num_steps=4,
                  sampler="flow_grpo", noise_level=0.7, generator=torch.Generator().manual_seed(0))
    f, h, w = DEFAULTS["num_frames"], DEFAULTS["height"], DEFAULTS["width"]
    assert out.samples.shape == (2, f, 3, h, w)
    assert out.latents.shape[:2] == (2, 5) and out.log_probs.shape == (2, 4)
    assert out.sde_mask.any() and torch.isfinite(out.log_probs[:, out.sde_mask]).all()
    assert 0 <= out.samples.min() and out.samples.max() <= 1


def test_model_is_small_in_safetensors_with_a_model_card():
    files = [p for p in MODEL.rglob("*") if p.is_file()]
    assert sum(p.stat().st_size for p in files) < 40 * 2**20
    weights = [p for p in files if p.suffix in {".bin", ".pt", ".pth", ".ckpt", ".safetensors"}]
    assert weights and all(p.suffix == ".safetensors" for p in weights)
    card = (MODEL / "README.md").read_text()
    assert "flowalign pretrain-tiny wan" in card and "easy" in card


def test_it_passes_held_out_motion_tasks():
    # trained, not just saved: whole easy motion tasks (right colour + shape in >= 80 % of the frames,
    # moving the prompted way) pass on held-out prompts. 7 of these 12 passed when it was exported (74 % of
    # 200 in the model card); the previous, weaker version passed none of them
    # the 12 tasks it was measured on when exported: the first easy draws of seed 2001, held-out ones included
    tasks = generate_tasks(12, seed=2001, level="easy", exclude_heldout=False)
    videos = sample_seeded(pipelines.load(MODEL), [t.prompt for t in tasks], seed=0, progress=False)
    passed = [verify(t, v).all_passed for t, v in zip(tasks, videos)]
    assert sum(passed) >= 5, passed
