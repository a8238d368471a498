"""Checks every model family must pass, shared by ``test_every_family.py`` and the per-family test files.

Each takes a tiny model folder (or a policy loaded from one) and runs the real code paths: the trainer's own
sampling and re-evaluation (ratio 1 on the first on-policy pass), two optimiser steps through ``build_trainer``
with LoRA and with full fine-tuning, the saved LoRA read back by the diffusers pipeline's own
``load_lora_weights``, an ODE rollout against the pipeline's own call, and CFG with a stored unconditional
velocity. The input images the image-conditioned families read live here too.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

import pipelines
from flowalign.protocols import Conditioning
from flowalign.train import build_trainer
from tests.flowalign.trainers.conftest import small_config

LORA = {"rank": 4, "alpha": 8}
PROMPTS = ["exactly two red circles", "a blue square left of a green triangle"]
#: editing instructions for :func:`edit_inputs`
EDIT_PROMPTS = ["make the red square blue", "remove the square"]


def edit_inputs() -> list:
    """Two 32 px input images for an editing family: a red and a green square at different places."""
    from PIL import Image

    images = []
    for i, colour in enumerate([(220, 30, 30), (30, 200, 30)]):
        image = Image.new("RGB", (32, 32), (250, 250, 250))
        image.paste(colour, (6 + 4 * i, 8, 22, 24))
        images.append(image)
    return images


def reference_images(size: int = 64) -> list:
    """Two ``size`` px reference images for FLUX.2 editing (its pipeline refuses sides under 64 px): a red and a
    green square."""
    from PIL import Image

    images = []
    for i, colour in enumerate([(220, 30, 30), (30, 200, 30)]):
        image = Image.new("RGB", (size, size), (250, 250, 250))
        image.paste(colour, (10 + 8 * i, 16, 44, 48))
        images.append(image)
    return images


def first_frame():
    """A 32 px first frame for an image-to-video family: a red square on grey."""
    from PIL import Image

    image = Image.new("RGB", (32, 32), (240, 240, 240))
    image.paste((200, 30, 30), (6, 10, 18, 22))
    return image


def ode(policy, x: torch.Tensor, cond, grid: torch.Tensor, guidance: float) -> torch.Tensor:
    """Euler over ``grid``: x ← x + (σ' - σ)·v (the convention every family's velocity follows)."""
    with torch.no_grad():
        for k in range(len(grid) - 1):
            x = x + (grid[k + 1] - grid[k]) * policy.velocity(x, grid[k], cond, guidance)
    return x


def prompt_file(tmp_path: Path, images: bool = False) -> Path:
    """Four prompts; with ``images``, a JSONL file whose rows name a 32² input PNG (relative paths)."""
    prompts = ["a red circle", "a blue square", "a green star", "a yellow triangle"]
    if not images:
        path = tmp_path / "prompts.txt"
        path.write_text("".join(p + "\n" for p in prompts))
        return path
    from PIL import Image

    (tmp_path / "inputs").mkdir(exist_ok=True)
    rows = []
    for i, prompt in enumerate(prompts):
        colour = [(220, 30, 30), (30, 30, 220), (30, 200, 30), (230, 220, 30)][i]
        image = Image.new("RGB", (32, 32), (255, 255, 255))
        image.paste(colour, (8 + i, 8, 20 + i, 20))
        image.save(tmp_path / "inputs" / f"{i}.png")
        rows.append(json.dumps({"prompt": f"make {prompt} purple", "image": f"inputs/{i}.png"}))
    path = tmp_path / "edits.jsonl"
    path.write_text("\n".join(rows) + "\n")
    return path


def check_ratio_one(folder: Path, tmp_path: Path, *extra: str, images: bool = False) -> None:
    """Stored SDE transitions re-evaluate to ratio 1 (log-prob difference ~0) with a fresh forward pass."""
    t = build_trainer(small_config(tmp_path / "ratio", folder, prompt_file(tmp_path, images), "trainer.beta=0.04",
                                   "trainer.num_steps=3", *extra))
    prompts, metadata, groups = t.step_prompts(0)
    batch = t.sample(prompts, metadata, groups)
    checked = 0
    with torch.no_grad():
        for chunk in batch.chunks:
            for k in t.trained_steps(chunk):
                x_k, _, stored = chunk.step(k)
                v = t.policy.velocity(x_k, chunk.sigmas[k].item(), chunk.cond, chunk.guidance_scale)
                again = t.step_distribution(chunk, k, v)
                assert torch.isfinite(stored).all()
                torch.testing.assert_close(again.log_prob, stored, rtol=0, atol=1e-4)
                checked += 1
    assert checked > 0


def check_two_training_steps(folder: Path, tmp_path: Path, finetune: str, *extra: str, images: bool = False) -> None:
    """Two optimiser steps through the trainer move the trained weights (and only those under LoRA)."""
    kl = ["trainer.beta=0.04"] if finetune == "lora" else ["trainer.beta=0"]
    t = build_trainer(small_config(tmp_path / f"train-{finetune}", folder, prompt_file(tmp_path, images),
                                   f"model.finetune={finetune}", "trainer.num_steps=3", "trainer.lr=1e-2", *kl, *extra))
    trained = {n: p.detach().clone() for n, p in t.policy.trainable.named_parameters() if p.requires_grad}
    frozen = {n: p.detach().clone() for n, p in t.policy.trainable.named_parameters() if not p.requires_grad}
    assert trained
    if finetune == "lora":
        assert all("lora_" in n for n in trained)
    else:
        assert not frozen
    for _ in range(2):
        metrics = t.train_step()
        t.step += 1
        assert all(torch.isfinite(torch.as_tensor(v)).all() for v in metrics.values() if isinstance(v, (int, float)))
    after = dict(t.policy.trainable.named_parameters())
    assert any(not torch.equal(after[n], trained[n]) for n in trained), "two steps left every weight unchanged"
    assert all(torch.equal(after[n], frozen[n]) for n in frozen), "a frozen weight moved"


def perturbed_lora_policy(folder: Path, **kw):
    """A LoRA policy whose adapter is moved off zero (so it changes the velocity)."""
    policy = pipelines.load(folder, lora=LORA, **kw)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in policy.trainable.parameters():
            if p.requires_grad:
                p.add_(0.2 * torch.randn(p.shape, generator=gen))
    return policy


def check_lora_loads_with_diffusers(folder: Path, tmp_path: Path, load_into_pipe=None, images=None) -> None:
    """``save_adapter`` writes what ``pipe.load_lora_weights`` reads: the loaded model has our velocity."""
    policy = perturbed_lora_policy(folder)
    w = float(policy.defaults["guidance_scale"])
    cond = policy.encode(PROMPTS) if images is None else policy.encode(PROMPTS, images=images)
    x = policy.initial_noise(2, torch.Generator().manual_seed(1))
    with torch.no_grad():
        v_ours = policy.velocity(x, 0.6, cond, w)
    policy.save_adapter(tmp_path / "adapter")
    fresh = pipelines.load(folder)
    with torch.no_grad():
        v_base = fresh.velocity(x, 0.6, cond, w)
    assert not torch.allclose(v_base, v_ours, atol=1e-4), "the perturbed adapter must change the velocity"
    if load_into_pipe is None:
        fresh.pipe.load_lora_weights(str(tmp_path / "adapter"))  # exactly what a diffusers user runs
    else:
        load_into_pipe(fresh.pipe, tmp_path / "adapter")
    with torch.no_grad():
        v_loaded = fresh.velocity(x, 0.6, cond, w)
    torch.testing.assert_close(v_loaded, v_ours, rtol=1e-5, atol=1e-5)


def check_meta_size(name: str) -> None:
    """The published config instantiated on the meta device has the published size (within 5%)."""
    from pipelines.tiny_twins.published import PUBLISHED, count_parameters, published_class, published_config

    size = PUBLISHED[name][1]
    n = count_parameters(published_class(name), published_config(name))
    assert abs(n - size) / size < 0.05, f"{name}: {n / 1e9:.2f}B parameters, published {size / 1e9:.0f}B"


def check_rollout_reproduces_pipeline(policy, x1: torch.Tensor, ours: torch.Tensor, *, latent_tol: float = 1e-5,
                                      pixel_tol: float = 1e-4, **pipe_kwargs) -> None:
    """Our ODE rollout ``ours`` from the noise ``x1`` ends at ``pipe(**pipe_kwargs)``'s final latents from the
    same noise, and our decode of it is the pipeline's own pixels (frames for a video family)."""

    def call(output_type: str) -> torch.Tensor:
        # a fresh copy of every list: ZImagePipeline applies its chat template to the prompt list in place
        kwargs = {k: list(v) if isinstance(v, list) else v for k, v in pipe_kwargs.items()}
        out = policy.pipe(**kwargs, latents=x1.clone(), output_type=output_type)
        return out.frames if policy.is_video else out.images

    with torch.no_grad():
        theirs, pixels, decoded = call("latent"), call("pt"), policy.decode(ours)
    torch.testing.assert_close(ours, theirs, rtol=latent_tol, atol=latent_tol)
    torch.testing.assert_close(decoded, pixels, rtol=pixel_tol, atol=pixel_tol)


def check_cfg_is_the_manual_combination(policy, w: float) -> None:
    """CFG at scale ``w`` is ``v_u + w(v_c - v_u)``, ``v_u`` the velocity of the negative prompt's embeddings (each
    ``negative_<key>`` tensor in the place of ``<key>``), and conditioning changes the velocity."""
    cond = policy.encode(PROMPTS)
    negatives = {k: cond.tensors[f"negative_{k}"] for k in cond.tensors if f"negative_{k}" in cond.tensors}
    assert negatives, "a CFG family encodes its negative prompt"
    uncond = Conditioning(negatives, [""] * len(PROMPTS))
    x = policy.initial_noise(2, torch.Generator().manual_seed(2))
    with torch.no_grad():
        v = policy.velocity(x, 0.7, cond, w)
        v_c = policy.velocity(x, 0.7, cond, 1.0)
        v_u = policy.velocity(x, 0.7, uncond, 1.0)
    assert not torch.allclose(v_c, v_u)
    torch.testing.assert_close(v, v_u + w * (v_c - v_u), rtol=1e-5, atol=1e-5)


def check_velocity_with_a_given_uncond(policy) -> None:
    """``velocity(..., uncond=v_u)`` is CFG with the stored unconditional velocity: exactly ``v_u + w(v_c - v_u)``
    with the conditional pass alone, equal to the batched pass up to float noise; ``v_u`` is the empty prompt's
    velocity."""
    cond = policy.encode(["a red circle", "two blue squares"])
    x = policy.initial_noise(2, torch.Generator().manual_seed(0))
    w = 4.5
    calls = []
    hook = policy.transformer.register_forward_hook(lambda m, a, out: calls.append(1))
    try:
        with torch.no_grad():
            v_u = policy.unconditional_velocity(x, 0.7, cond)
            v_c = policy.velocity(x, 0.7, cond, 1.0)
            batched = policy.velocity(x, 0.7, cond, w)
            n = len(calls)
            split = policy.velocity(x, 0.7, cond, w, uncond=v_u)
            assert len(calls) == n + 1, "one forward: the conditional half"
            empty = policy.velocity(x, 0.7, policy.encode(["", ""]), 1.0)
    finally:
        hook.remove()
    assert torch.equal(split, v_u + w * (v_c - v_u))
    assert torch.equal(v_u, empty)
    torch.testing.assert_close(split, batched, rtol=1e-5, atol=1e-5)
