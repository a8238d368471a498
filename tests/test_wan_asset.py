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
from rewards.vvr_motion import load_split, verify

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
    assert "pretrain_tiny.py --family wan" in card and "easy" in card


def test_it_draws_the_prompted_objects_on_held_out_tasks():
    # trained, not just saved: the verifier finds the prompted object (colour + shape) in some frames of
    # these held-out clips. An untrained model draws no coloured shapes at all (found nowhere). The shipped
    # model passes few whole motion tasks (README: 5 % of easy ones), so this is the property
    # it does have (7 of these 12 clips when it was exported; at least 3 must still be)
    tasks = load_split("easy", 12)
    videos = sample_seeded(pipelines.load(MODEL), [t.prompt for t in tasks], seed=0, progress=False)
    # frames (of 9) in which each clip's single named object is found
    found = [track["found"].count("1") for t, v in zip(tasks, videos) for track in verify(t, v).detected]
    assert sum(f > 0 for f in found) >= 3, found
