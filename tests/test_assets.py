"""The shipped tiny model opens offline exactly as a real checkpoint does, and samples."""

import json

import torch
from diffusers import StableDiffusion3Pipeline

import pipelines
from flowalign.paths import default_model_dir
from flowalign.sampling import rollout

MODEL = default_model_dir()


def test_plain_diffusers_from_pretrained_opens_every_component():
    pipe = StableDiffusion3Pipeline.from_pretrained(MODEL)
    assert pipe.text_encoder is not None and pipe.text_encoder_2 is not None and pipe.text_encoder_3 is not None
    pipe.set_progress_bar_config(disable=True)
    image = pipe("a red circle", num_inference_steps=2, height=64, width=64, max_sequence_length=48,
                 output_type="pt", generator=torch.Generator().manual_seed(0)).images
    assert image.shape == (1, 3, 64, 64) and torch.isfinite(image).all()


def test_pipelines_load_picks_the_trained_sampling_defaults():
    defaults = json.loads((MODEL / "flowalign.json").read_text())
    policy = pipelines.load(MODEL)
    for key in ("height", "width", "guidance_scale", "num_steps", "max_sequence_length", "shift"):
        assert policy.defaults[key] == defaults[key]
    out = rollout(policy, ["a blue square"], num_steps=3, sampler="flow_grpo", generator=torch.Generator().manual_seed(0))
    assert out.samples.shape == (1, 3, defaults["height"], defaults["width"])
    assert torch.isfinite(out.log_probs[:, out.sde_mask]).all()


def test_model_is_small_and_in_safetensors():
    files = [p for p in MODEL.rglob("*") if p.is_file()]
    assert sum(p.stat().st_size for p in files) < 40 * 2**20
    weights = [p for p in files if p.suffix in {".bin", ".pt", ".pth", ".ckpt", ".safetensors"}]
    assert weights and all(p.suffix == ".safetensors" for p in weights)
    assert (MODEL / "README.md").exists()
