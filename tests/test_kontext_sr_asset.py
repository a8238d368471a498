"""The shipped tiny super-resolution model (assets/tiny-kontext-sr) opens as a FLUX.1 Kontext checkpoint,
is small, and was trained: on held-out sr test scenes it restores structure the bicubic upscale blurs."""

import torch

import pipelines
from flowalign.evaluation import sample_seeded
from flowalign.paths import assets_dir
from flowalign.sampling.inputs import load_input_image
from rewards.compass import CompassFR, resize
from rewards.sr import HR_SIZE, load_split, render_lr

MODEL = assets_dir() / "tiny-kontext-sr"


def test_model_is_small_in_safetensors_with_a_model_card():
    files = [p for p in MODEL.rglob("*") if p.is_file()]
    assert sum(p.stat().st_size for p in files) < 40 * 2**20
    weights = [p for p in files if p.suffix in {".bin", ".pt", ".pth", ".ckpt", ".safetensors"}]
    assert weights and all(p.suffix == ".safetensors" for p in weights)
    assert (MODEL / "README.md").exists()


def test_it_sharpens_held_out_lr_scenes_beyond_the_bicubic_upscale():
    tasks = load_split("medium", "test", n=4)
    metadata = [{"task": t.to_dict(), "image": render_lr(t)} for t in tasks]
    policy = pipelines.load(MODEL)
    assert policy.family == "kontext"
    sr = sample_seeded(policy, [t.prompt for t in tasks], seed=0, num_steps=8, progress=False, metadata=metadata)
    bicubic = torch.cat([resize(load_input_image(m["image"])[None], (HR_SIZE, HR_SIZE)) for m in metadata])
    reward = CompassFR()
    model, base = reward.score(sr, [""] * 4, metadata), reward.score(bicubic, [""] * 4, metadata)
    # an untrained or copying model scores no gain; this one adds edges and keeps the HR's structure
    assert model["gain"].mean() > 0.5 and model["ssim"].mean() > base["ssim"].mean()
