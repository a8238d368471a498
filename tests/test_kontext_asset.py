"""The shipped tiny editing model (assets/tiny-kontext-vvr-edit) opens offline as a real FLUX.1 Kontext
checkpoint does, and edits (it was trained, not just saved)."""

import torch
from diffusers import FluxKontextPipeline

import pipelines
from flowalign.evaluation import sample_seeded
from flowalign.paths import assets_dir
from rewards.benchmarks import EDIT_IMAGE_SIZE
from rewards.vvr_edit import load_split, render_source, verify_edit

MODEL = assets_dir() / "tiny-kontext-vvr-edit"


def test_plain_diffusers_from_pretrained_edits_an_image():
    pipe = FluxKontextPipeline.from_pretrained(MODEL)
    pipe.set_progress_bar_config(disable=True)
    task = load_split("easy", "test")[0]
    image = pipe(image=render_source(task, size=64), prompt=task.prompt, height=64, width=64, num_inference_steps=2,
                 guidance_scale=1.0, max_sequence_length=16, max_area=64 * 64, _auto_resize=False,
                 output_type="pt", generator=torch.Generator().manual_seed(0)).images
    assert image.shape == (1, 3, 64, 64) and torch.isfinite(image).all()


def test_model_is_small_in_safetensors_with_a_model_card():
    files = [p for p in MODEL.rglob("*") if p.is_file()]
    assert sum(p.stat().st_size for p in files) < 40 * 2**20
    weights = [p for p in files if p.suffix in {".bin", ".pt", ".pth", ".ckpt", ".safetensors"}]
    assert weights and all(p.suffix == ".safetensors" for p in weights)
    assert (MODEL / "README.md").exists() and pipelines.load(MODEL).family == "kontext"


def test_it_removes_objects_on_held_out_edit_tasks():
    # trained, not just saved: the first 8 "remove" tasks of the easy test split (held-out compositions;
    # the model card measured 20 of all 25 removes; these 8 gave 5 when it was exported); returning the
    # source unedited passes none of them
    tasks = [t for t in load_split("easy", "test") if t.prompt.startswith("remove")][:8]
    sources = [render_source(t, size=EDIT_IMAGE_SIZE) for t in tasks]
    assert not any(verify_edit(t, s).all_passed for t, s in zip(tasks, sources))
    edits = sample_seeded(pipelines.load(MODEL), [t.prompt for t in tasks], seed=0, progress=False,
                          metadata=[{"image": s} for s in sources])
    passed = [verify_edit(t, e).all_passed for t, e in zip(tasks, edits)]
    assert sum(passed) >= 3, passed
