"""Pretrain the embedded tiny SD3-format text-to-image model on rendered VVR scenes, on CPU.

Commands that produced the shipped ``assets/tiny-sd3-vvr`` (two invocations, 47.3 + 25.1 min wall on 2 shared
CPU cores; details, data and accuracies in its README.md):

    # phase 1 (this script at commit 5936a16: no decoder stage, VAE loss without foreground weighting)
    nohup .venv/bin/python scripts/pretrain_tiny.py --out runs/pretrain-tiny --export assets/tiny-sd3-vvr \
        --vae-minutes 10 --dit-minutes 32 --seed 0 > /tmp/pretrain.log 2>&1 &
    # phase 2 (commit 7788773): decoder fine-tuning, then the finished DiT stage continued to 52 min, easy-weighted
    nohup .venv/bin/python scripts/pretrain_tiny.py --out runs/pretrain-tiny --export assets/tiny-sd3-vvr --resume \
        --vae-minutes 10 --dec-minutes 5 --dit-minutes 52 --dit-level-weights easy:0.6,medium:0.3,hard:0.1 \
        --seed 0 > /tmp/pretrain2.log 2>&1 &
    # then flowalign.json's guidance_scale set to 3.0 (a CFG sweep on held-out easy tasks; now the --cfg default)
    # phase 3 (2026-11-30): deepened to 8 blocks, fresh scenes, then the pooled text vector hidden half the
    # time (--pooled-drop); the exact two invocations are in the model card
    .venv/bin/python scripts/pretrain_tiny.py --init-from PHASE2_FOLDER --num-layers 8 --out runs/pretrain-v3 \
        --export runs/tiny-sd3-vvr-v3 --n-scenes 60000 --mix easy:0.3,medium:0.45,hard:0.25 --seed 1 \
        --dit-minutes 73 --lr 5e-4 --pooled-drop 0.5 --eval-n 200   # (pooled drop from step 1,200 in the shipped run)

From scratch with this version, one command does all stages in that order of data use (not bit-identical:
VAE loss and LR schedule differ slightly from the two-phase run):

    .venv/bin/python scripts/pretrain_tiny.py --out runs/pretrain-tiny --export assets/tiny-sd3-vvr \
        --vae-minutes 10 --dec-minutes 5 --dit-minutes 52 --dit-level-weights easy:0.6,medium:0.3,hard:0.1

Stages (each resumable; ``--resume`` continues from the newest complete checkpoint of the stage it
was in, and a finished stage is never redone):

1. data     render ``--n-scenes`` VVR scenes once (seeds < 1000; ≥ 1000 are the benchmark splits) into
            a uint8 cache, a mixture of levels (``--mix easy:0.45,medium:0.4,hard:0.15``).
2. vae      ``AutoencoderKL`` (SD3 style, f4: 64 px -> 16×16×4) on the scenes, L1 + MSE + small KL,
            two learning-rate stages (32 px crops at a high rate, then full scenes at a low rate; a single
            high rate shifts colours); then ``shift_factor`` / ``scaling_factor`` from the latent
            statistics (mean, 1/std).
3. latents  encode every scene once (posterior mean), normalised as the pipeline expects:
            ``x0 = (z - shift_factor) * scaling_factor``.
3b. decoder decoder-only fine-tuning on those latents (encoder frozen, so the latents stay valid),
            foreground-weighted, cosine LR: fixes the colour shifts (green, black) a short VAE run leaves.
4. dit      ``SD3Transformer2DModel`` + the three text encoders (CLIP-L, CLIP-G, T5 stand-ins) trained
            jointly with the rectified-flow loss of conventions.md: ``x_σ = (1-σ)x0 + σε``,
            target ``v = ε - x0``, ``timestep = 1000σ``, σ logit-normal(0, 1); 10% of prompts dropped to
            "" for classifier-free guidance. Text embeddings come from ``pipe.encode_prompt`` itself
            (grad enabled), so training sees exactly what inference feeds the transformer. AdamW, EMA.
5. export   a diffusers folder with the EMA weights (``StableDiffusion3Pipeline.from_pretrained``
            opens it offline), ``flowalign.json`` sampling defaults, a sample grid and a model card.
6. eval     (optional, ``--eval-n``) verifier accuracy on the validation split ``assets/vvr/<level>/validation.jsonl``.

Checkpoints: ``OUT/<stage>/step-XXXXXX/`` (weights as safetensors, optimiser/RNG/progress as a torch
file), written to a temp folder and renamed; only the newest two are kept.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import random
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# on shared cores, spinning OpenMP workers stall whenever a sibling thread is descheduled (5-10x slower steps)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

log = logging.getLogger("pretrain_tiny")

# --------------------------------------------------------------------------------------------------
# The shipped architecture (overrides for pipelines.tiny.build_tiny_sd3)
# --------------------------------------------------------------------------------------------------

IMAGE_SIZE = 64


def model_overrides(t5_words: list[str], clip_max_length: int, t5_max_length: int) -> dict:
    """SD3.5-Large-like MMDiT (qk RMS-norm, no dual attention), 4 layers × width 128, patch 2 on
    16×16×4 latents; f4 SD3-style VAE; CLIP-L/G stand-ins (width 64, real CLIP BPE truncated to 16k
    tokens); T5 stand-in (width 128 = 64 + 64, word-level vocabulary incl. every training word)."""
    return dict(
        seed=0,
        height=IMAGE_SIZE,
        clip_vocab_size=16384,
        clip_max_length=clip_max_length,
        t5_max_length=t5_max_length,
        t5_extra_words=tuple(t5_words),
        transformer=dict(
            patch_size=2, in_channels=4, out_channels=4, num_layers=4, attention_head_dim=32,
            num_attention_heads=4, caption_projection_dim=128, pos_embed_max_size=16,
            qk_norm="rms_norm", dual_attention_layers=[],
        ),
        vae=dict(block_out_channels=[32, 64, 64], layers_per_block=1, latent_channels=4, norm_num_groups=16,
                 scaling_factor=1.0, shift_factor=0.0, mid_block_add_attention=True),
        text_encoder=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                          projection_dim=64),
        text_encoder_2=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                            projection_dim=64),
        text_encoder_3=dict(d_model=128, d_kv=32, d_ff=256, num_layers=2, num_heads=4,
                            relative_attention_num_buckets=16, relative_attention_max_distance=64),
        scheduler=dict(shift=1.0),
    )


# --------------------------------------------------------------------------------------------------
# Checkpoint helpers (atomic: temp folder, then rename)
# --------------------------------------------------------------------------------------------------


def _tensors(prefix: str, module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {f"{prefix}.{k}": v.detach().clone().contiguous() for k, v in module.state_dict().items()}


def save_ckpt(stage_dir: Path, step: int, weights: dict[str, torch.Tensor], state: dict, keep: int = 2) -> Path:
    from safetensors.torch import save_file

    stage_dir.mkdir(parents=True, exist_ok=True)
    final = stage_dir / f"step-{step:06d}"
    tmp = stage_dir / f".tmp-step-{step:06d}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    save_file(weights, str(tmp / "weights.safetensors"))
    torch.save(state, tmp / "train_state.pt")
    (tmp / "COMPLETE").write_text("ok\n")
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    for old in sorted(stage_dir.glob("step-*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest_ckpt(stage_dir: Path) -> Path | None:
    done = [p for p in sorted(stage_dir.glob("step-*")) if (p / "COMPLETE").is_file()]
    return done[-1] if done else None


def load_ckpt(path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    from safetensors.torch import load_file

    return load_file(str(path / "weights.safetensors")), torch.load(path / "train_state.pt", weights_only=False)


def _load_prefixed(module: torch.nn.Module, weights: dict[str, torch.Tensor], prefix: str) -> None:
    sd = {k[len(prefix) + 1 :]: v for k, v in weights.items() if k.startswith(prefix + ".")}
    missing, unexpected = module.load_state_dict(sd, strict=False)
    if unexpected or [m for m in missing if "embed_tokens" not in m]:
        raise RuntimeError(f"{prefix}: missing {missing[:5]}, unexpected {unexpected[:5]}")


def _rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}


def _set_rng_state(s: dict) -> None:
    torch.set_rng_state(s["torch"])
    np.random.set_state(s["numpy"])
    random.setstate(s["python"])


# --------------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------------


def parse_mix(spec: str) -> dict[str, float]:
    out = {}
    for part in spec.split(","):
        name, _, w = part.partition(":")
        out[name.strip()] = float(w)
    total = sum(out.values())
    return {k: v / total for k, v in out.items()}


def _synthetic_scenes(n: int, seed: int):
    """Fallback data (``--synthetic``): coloured circles/squares/triangles with simple relations."""
    from PIL import Image, ImageDraw

    colours = {"red": (230, 25, 35), "green": (30, 170, 50), "blue": (30, 60, 220), "yellow": (245, 210, 20),
               "purple": (140, 40, 180), "orange": (250, 130, 20)}
    shapes = ["circle", "square", "triangle"]
    rng = random.Random(seed)

    def draw(d, shape, col, cx, cy, r):
        if shape == "circle":
            d.ellipse([cx - r, cy - r, cx + r, cy + r], fill=col)
        elif shape == "square":
            d.rectangle([cx - r, cy - r, cx + r, cy + r], fill=col)
        else:
            d.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=col)

    images, prompts = [], []
    for _ in range(n):
        img = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), (255, 255, 255))
        d = ImageDraw.Draw(img)
        c1, s1 = rng.choice(list(colours)), rng.choice(shapes)
        if rng.random() < 0.5:
            draw(d, s1, colours[c1], rng.randint(20, 44), rng.randint(20, 44), rng.randint(8, 14))
            prompts.append(f"On a white background, a {c1} {s1}.")
        else:
            c2, s2 = rng.choice([c for c in colours if c != c1]), rng.choice(shapes)
            x1, x2 = rng.randint(12, 24), rng.randint(40, 52)
            y1, y2 = rng.randint(14, 50), rng.randint(14, 50)
            draw(d, s1, colours[c1], x1, y1, 8)
            draw(d, s2, colours[c2], x2, y2, 8)
            prompts.append(f"On a white background, a {c1} {s1} is left of a {c2} {s2}.")
        images.append(np.asarray(img))
    return images, prompts


def build_dataset(n: int, mix: dict[str, float], seed: int, synthetic: bool) -> dict:
    """Render ``n`` training scenes once: uint8 images (N,3,H,W), prompts, levels."""
    from tqdm import tqdm

    images: list[np.ndarray] = []
    prompts: list[str] = []
    levels: list[str] = []
    if synthetic:
        images, prompts = _synthetic_scenes(n, seed)
        levels = ["synthetic"] * n
    else:
        from rewards.vvr import generate_tasks, render

        for i, (level, w) in enumerate(mix.items()):
            k = int(round(n * w)) if i < len(mix) - 1 else n - len(images)
            task_seed = seed * 10 + i  # training seeds < 1000 (the benchmark splits use >= 1000)
            if task_seed >= 1000:
                raise ValueError(f"--seed {seed} gives task seed {task_seed} >= 1000 (reserved for benchmarks)")
            tasks = generate_tasks(k, seed=task_seed, level=level)
            for t in tqdm(tasks, desc=f"render {level}", mininterval=5):
                img = render(t, size=IMAGE_SIZE).convert("RGB")
                images.append(np.asarray(img))
                prompts.append(t.prompt)
                levels.append(level)
    arr = torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2).contiguous()
    return {"images": arr, "prompts": prompts, "levels": levels}


def vocabulary(prompts: list[str]) -> list[str]:
    words: dict[str, None] = {}
    for p in prompts:
        for w in p.replace(",", " ").replace(";", " ").replace(".", " ").replace(":", " ").split():
            words.setdefault(w.strip("\"'()"), None)
    return sorted(w for w in words if w)


# --------------------------------------------------------------------------------------------------
# Training utilities
# --------------------------------------------------------------------------------------------------


class Budget:
    """Time and/or step budget of a stage, carried over resumes via ``elapsed``."""

    def __init__(self, minutes: float | None, steps: int | None, elapsed: float = 0.0):
        self.seconds = None if minutes is None else minutes * 60.0
        self.steps = steps
        self.elapsed0 = elapsed
        self.t0 = time.time()

    @property
    def elapsed(self) -> float:
        return self.elapsed0 + time.time() - self.t0

    def fraction(self, step: int) -> float:
        fs = [0.0]
        if self.seconds:
            fs.append(self.elapsed / self.seconds)
        if self.steps:
            fs.append(step / self.steps)
        return min(1.0, max(fs))

    def done(self, step: int) -> bool:
        return self.fraction(step) >= 1.0


class EMA:
    def __init__(self, params: list[torch.nn.Parameter], decay: float):
        self.params = params
        self.decay = decay
        self.shadow = [p.detach().clone() for p in params]

    @torch.no_grad()
    def update(self, step: int) -> None:
        d = min(self.decay, (1 + step) / (10 + step))
        torch._foreach_lerp_(self.shadow, [p.detach() for p in self.params], 1 - d)

    @torch.no_grad()
    def copy_to(self) -> None:
        for s, p in zip(self.shadow, self.params):
            p.copy_(s)


def _progress(total_seconds: float | None, desc: str):
    from tqdm import tqdm

    total = int(total_seconds) if total_seconds else None
    return tqdm(total=total, desc=desc, unit="s", mininterval=10, dynamic_ncols=False, ncols=110,
                bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt}s [{elapsed}<{remaining}] {postfix}")


# --------------------------------------------------------------------------------------------------
# Stage 2: VAE
# --------------------------------------------------------------------------------------------------


def train_vae(pipe, data: dict, args, out: Path) -> None:
    vae = pipe.vae
    stage = out / "vae"
    if (stage / "DONE").is_file():
        w, _ = load_ckpt(latest_ckpt(stage))
        _load_prefixed(vae, w, "vae")
        return
    images = data["images"]
    opt = torch.optim.AdamW(vae.parameters(), lr=args.vae_lr, weight_decay=0.0, betas=(0.9, 0.99))
    step, elapsed = 0, 0.0
    ck = latest_ckpt(stage) if args.resume else None
    if ck is not None:
        w, st = load_ckpt(ck)
        _load_prefixed(vae, w, "vae")
        opt.load_state_dict(st["opt"])
        step, elapsed = st["step"], st["elapsed"]
        _set_rng_state(st["rng"])
        log.info("vae: resumed from %s (step %d, %.1f min)", ck, step, elapsed / 60)
    budget = Budget(args.vae_minutes, args.vae_steps, elapsed)
    vae.train()
    bar = _progress(budget.seconds, "vae")
    bar.update(int(elapsed))
    ema_loss = None
    while not budget.done(step):
        frac = budget.fraction(step)
        # two LR stages: high rate, then a low rate for the last 40% (fixes colour shifts)
        lr = args.vae_lr if frac < 0.6 else args.vae_lr2
        lr *= min(1.0, (step + 1) / 100)
        for g in opt.param_groups:
            g["lr"] = lr
        idx = torch.randint(0, len(images), (args.vae_batch,))
        x = images[idx].float() / 127.5 - 1.0
        if frac < 0.6 and args.vae_crop:
            # stage 1 on random crops (the VAE is fully convolutional; 4x cheaper at 32 px)
            c = args.vae_crop
            i, j = (int(v) for v in torch.randint(0, (IMAGE_SIZE - c) // 4 + 1, (2,)) * 4)
            x = x[:, :, i : i + c, j : j + c]
        post = vae.encode(x).latent_dist
        rec = vae.decode(post.sample()).sample
        kl = post.kl().mean() / x[0].numel()
        wgt = _fg_weight(x, args.fg_weight)
        loss = (wgt * ((rec - x).abs() + (rec - x) ** 2)).mean() / wgt.mean() + args.vae_kl * kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
        opt.step()
        step += 1
        ema_loss = loss.item() if ema_loss is None else 0.95 * ema_loss + 0.05 * loss.item()
        bar.n = int(budget.elapsed)
        bar.set_postfix_str(f"step {step} loss {ema_loss:.4f} lr {lr:.1e}", refresh=False)
        bar.update(0)
        if step % 50 == 0:
            log.info("vae step %d loss %.4f kl %.3f lr %.1e elapsed %.1fmin", step, ema_loss, kl.item(), lr,
                     budget.elapsed / 60)
        if step % args.save_every == 0:
            save_ckpt(stage, step, _tensors("vae", vae),
                      {"opt": opt.state_dict(), "step": step, "elapsed": budget.elapsed, "rng": _rng_state()})
    bar.close()
    vae.eval()
    save_ckpt(stage, step, _tensors("vae", vae),
              {"opt": opt.state_dict(), "step": step, "elapsed": budget.elapsed, "rng": _rng_state()})
    (stage / "DONE").write_text(json.dumps({"step": step, "minutes": budget.elapsed / 60}) + "\n")
    log.info("vae: done, %d steps in %.1f min", step, budget.elapsed / 60)


@torch.no_grad()
def encode_latents(pipe, data: dict, out: Path, batch: int = 256, keep_factors: bool = False) -> torch.Tensor:
    """Posterior means of every scene; sets the VAE's shift/scaling factors from their statistics
    (``keep_factors``: a pretrained VAE keeps its own, which its transformer was trained with)."""
    path = out / "latents.pt"
    vae = pipe.vae.eval()
    if path.is_file():
        cache = torch.load(path)
        vae.register_to_config(shift_factor=cache["shift_factor"], scaling_factor=cache["scaling_factor"])
        return cache["x0"]
    from tqdm import tqdm

    zs = []
    images = data["images"]
    for i in tqdm(range(0, len(images), batch), desc="encode latents", mininterval=10):
        x = images[i : i + batch].float() / 127.5 - 1.0
        zs.append(vae.encode(x).latent_dist.mean)
    z = torch.cat(zs)
    if keep_factors:
        shift, scale = float(vae.config.shift_factor), float(vae.config.scaling_factor)
    else:
        shift, scale = float(z.mean()), float(1.0 / z.std())
        vae.register_to_config(shift_factor=shift, scaling_factor=scale)
    x0 = (z - shift) * scale
    rec = vae.decode(z[:64]).sample
    err = (rec - (images[:64].float() / 127.5 - 1)).abs().mean().item() * 127.5
    log.info("latents: %s shift_factor %.4f scaling_factor %.4f; recon MAE %.2f/255", tuple(z.shape), shift, scale,
             err)
    tmp = path.with_suffix(".tmp")
    torch.save({"x0": x0, "shift_factor": shift, "scaling_factor": scale}, tmp)
    os.replace(tmp, path)
    return x0


def _fg_weight(x: torch.Tensor, fg: float) -> torch.Tensor:
    """Per-pixel loss weight: ``fg`` on pixels that differ from the corner (background) colour, else 1.
    Objects cover a few percent of a scene; without it their colours are the last thing a VAE gets right."""
    bg = x[:, :, :1, :1]
    return 1.0 + (fg - 1.0) * ((x - bg).abs().amax(dim=1, keepdim=True) > 0.05).float()


def finetune_decoder(pipe, data: dict, x0: torch.Tensor, args, out: Path) -> None:
    """Stage 3b: decoder-only fine-tuning on the cached latents (encoder frozen, so the latents and the
    transformer trained on them stay valid), full 64 px scenes, foreground-weighted L1 + MSE, cosine LR
    to zero, small latent noise for robustness to imperfect samples. Fixes the colour shifts (e.g. green,
    black) a short VAE run leaves."""
    if not args.dec_minutes and not args.dec_steps:
        return
    vae = pipe.vae
    dec = [vae.decoder] + ([vae.post_quant_conv] if vae.post_quant_conv is not None else [])
    stage = out / "decoder"
    if (stage / "DONE").is_file():
        w, _ = load_ckpt(latest_ckpt(stage))
        _load_prefixed(vae, w, "vae")
        return
    params = [p for m in dec for p in m.parameters()]
    opt = torch.optim.AdamW(params, lr=args.dec_lr, weight_decay=0.0, betas=(0.9, 0.99))
    step, elapsed = 0, 0.0
    ck = latest_ckpt(stage) if args.resume else None
    if ck is not None:
        w, st = load_ckpt(ck)
        _load_prefixed(vae, w, "vae")
        opt.load_state_dict(st["opt"])
        step, elapsed = st["step"], st["elapsed"]
        _set_rng_state(st["rng"])
        log.info("decoder: resumed from %s (step %d, %.1f min)", ck, step, elapsed / 60)
    budget = Budget(args.dec_minutes, args.dec_steps, elapsed)
    shift, scale = vae.config.shift_factor, vae.config.scaling_factor
    for p in params:
        p.requires_grad_(True)
    for m in dec:
        m.train()
    images = data["images"]
    bar = _progress(budget.seconds, "decoder")
    bar.update(int(elapsed))
    ema_loss = None
    while not budget.done(step):
        frac = budget.fraction(step)
        lr = args.dec_lr * 0.5 * (1 + math.cos(math.pi * frac)) * min(1.0, (step + 1) / 20)
        for g in opt.param_groups:
            g["lr"] = lr
        idx = torch.randint(0, len(images), (args.dec_batch,))
        x = images[idx].float() / 127.5 - 1.0
        z = (x0[idx] + args.dec_noise * torch.randn_like(x0[idx])) / scale + shift
        rec = vae.decode(z).sample
        wgt = _fg_weight(x, args.fg_weight)
        loss = (wgt * ((rec - x).abs() + (rec - x) ** 2)).mean() / wgt.mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        ema_loss = loss.item() if ema_loss is None else 0.95 * ema_loss + 0.05 * loss.item()
        bar.n = int(budget.elapsed)
        bar.set_postfix_str(f"step {step} loss {ema_loss:.4f} lr {lr:.1e}", refresh=False)
        bar.update(0)
        if step % 50 == 0:
            log.info("decoder step %d loss %.4f lr %.1e elapsed %.1fmin", step, ema_loss, lr, budget.elapsed / 60)
        if step % args.save_every == 0:
            save_ckpt(stage, step, _tensors("vae", vae),
                      {"opt": opt.state_dict(), "step": step, "elapsed": budget.elapsed, "rng": _rng_state()})
    bar.close()
    vae.eval().requires_grad_(False)
    save_ckpt(stage, step, _tensors("vae", vae),
              {"opt": opt.state_dict(), "step": step, "elapsed": budget.elapsed, "rng": _rng_state()})
    (stage / "DONE").write_text(json.dumps({"step": step, "minutes": budget.elapsed / 60}) + "\n")
    log.info("decoder: done, %d steps in %.1f min", step, budget.elapsed / 60)


# --------------------------------------------------------------------------------------------------
# Stage 4: transformer + text encoders
# --------------------------------------------------------------------------------------------------

TRAINED = ("transformer", "text_encoder", "text_encoder_2", "text_encoder_3")


def deepen_transformer(old, num_layers: int):
    """A deeper copy of an ``SD3Transformer2DModel`` that computes exactly the same function.

    Old block ``k`` of ``L`` goes to position ``(k + 1)·num_layers/L − 1`` (so the last, context-pre-only
    block stays last); the new blocks in between get zero adaLN modulation (DiT's adaLN-Zero), which
    makes a joint block the identity on both streams until training moves its gates. Everything else
    (patch and time/text embeddings, output head) is copied.
    """
    from diffusers import SD3Transformer2DModel

    L = old.config.num_layers
    if num_layers < L or num_layers % L:
        raise ValueError(f"--num-layers {num_layers}: must be a multiple of the initial model's {L} layers")
    placed = {(k + 1) * num_layers // L - 1: k for k in range(L)}
    at = {k: j for j, k in placed.items()}
    dual = sorted(at[k] for k in old.config.dual_attention_layers or ())  # SD3.5-Medium-style blocks move too
    new = SD3Transformer2DModel.from_config({**old.config, "num_layers": num_layers, "dual_attention_layers": dual})
    state = {}
    for name, t in old.state_dict().items():
        if name.startswith("transformer_blocks."):
            k = int(name.split(".")[1])
            name = f"transformer_blocks.{at[k]}." + name.split(".", 2)[2]
        state[name] = t
    with torch.no_grad():
        for j, block in enumerate(new.transformer_blocks):
            if j in placed:
                continue
            for norm in (block.norm1, block.norm1_context):
                norm.linear.weight.zero_()
                norm.linear.bias.zero_()
            state.update({f"transformer_blocks.{j}.{n}": t for n, t in block.state_dict().items()})
    new.load_state_dict(state, strict=True)
    return new


def _dit_weights(pipe, trained: tuple[str, ...], ema: EMA,
                 names_params: list[tuple[str, torch.nn.Parameter]]) -> dict[str, torch.Tensor]:
    w = {}
    for name in trained:
        w.update(_tensors(name, getattr(pipe, name)))
    for (n, _), s in zip(names_params, ema.shadow):
        w[f"ema.{n}"] = s.detach().clone().contiguous()
    return w


def _stage_state(opt, step: int, budget: Budget, **extra) -> dict:
    return {"opt": opt.state_dict(), "step": step, "elapsed": budget.elapsed, "rng": _rng_state(), **extra}


def sd3_conditioning(pipe, args, max_seq: int) -> Callable[[list[str]], dict[str, torch.Tensor]]:
    """``prompts → transformer kwargs`` for SD3: the token sequence and the pooled vector, both from
    ``pipe.encode_prompt`` with gradients on (training sees exactly what inference feeds the transformer)."""

    def encode(prompts: list[str]) -> dict[str, torch.Tensor]:
        pe, _, pooled, _ = pipe.encode_prompt(
            prompt=prompts, prompt_2=None, prompt_3=None, do_classifier_free_guidance=False,
            max_sequence_length=max_seq, device=torch.device("cpu"),
        )
        if args.pooled_drop > 0:
            # the pooled CLIP vector conditions every token through adaLN and is a shortcut that a
            # one-object prompt can be drawn from; without it the model must read the token sequence
            # through attention, which is where two objects' colours and shapes are bound to them
            _, _, empty_pooled, _ = pipe.encode_prompt(
                prompt=[""], prompt_2=None, prompt_3=None, do_classifier_free_guidance=False,
                max_sequence_length=max_seq, device=torch.device("cpu"),
            )
            hide = torch.rand(len(prompts)) < args.pooled_drop
            pooled = torch.where(hide[:, None], empty_pooled.expand_as(pooled), pooled)
        return {"encoder_hidden_states": pe, "pooled_projections": pooled}

    return encode


def train_dit(pipe, data: dict, x0: torch.Tensor, args, out: Path, max_seq: int, *,
              trained: tuple[str, ...] = TRAINED,
              conditioning: Callable[[list[str]], dict[str, torch.Tensor]] | None = None) -> EMA:
    """Rectified-flow training of the transformer and text encoders (``trained``) on cached latents
    ``x0 (N, ...)``; ``conditioning`` turns a batch of prompts into the transformer's text kwargs (SD3's by
    default; the Wan script passes its own). Resumable; returns the EMA of the trained weights."""
    conditioning = conditioning or sd3_conditioning(pipe, args, max_seq)
    stage = out / "dit"
    prompts = data["prompts"]
    names_params = []
    for name in trained:
        seen = set()
        for n, p in getattr(pipe, name).named_parameters():
            if id(p) in seen:  # tied weights (UMT5's shared / embed_tokens) train once
                continue
            seen.add(id(p))
            names_params.append((f"{name}.{n}", p))
    params = [p for _, p in names_params]
    for p in params:
        p.requires_grad_(True)
    decay, no_decay = [], []
    for n, p in names_params:
        (no_decay if p.ndim < 2 or "norm" in n or "embed" in n or "shared" in n else decay).append(p)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.wd}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.99))
    ema = EMA(params, args.ema)
    step, elapsed = 0, 0.0
    done = (stage / "DONE").is_file()
    ck = latest_ckpt(stage) if (args.resume or done) else None
    if ck is not None:
        w, st = load_ckpt(ck)
        for name in trained:
            _load_prefixed(getattr(pipe, name), w, name)
        for i, (n, _) in enumerate(names_params):
            ema.shadow[i].copy_(w[f"ema.{n}"])
        opt.load_state_dict(st["opt"])
        step, elapsed = st["step"], st["elapsed"]
        restart_step = st.get("restart_step", 0)
        _set_rng_state(st["rng"])
        log.info("dit: resumed from %s (step %d, %.1f min)", ck, step, elapsed / 60)
    else:
        restart_step = 0
    budget = Budget(args.dit_minutes, args.dit_steps, elapsed)
    if done:
        if not (args.resume and not budget.done(step)):
            return ema
        # continuation: a finished stage resumed with a larger budget; the LR re-warms from here
        (stage / "DONE").unlink()
        restart_step = step
        log.info("dit: continuing a finished stage at step %d up to %s min / %s steps", step, args.dit_minutes,
                 args.dit_steps)
    weights = None
    if args.dit_level_weights:
        lw = parse_mix(args.dit_level_weights)
        levels = data["levels"]
        count = {lv: levels.count(lv) for lv in set(levels)}
        weights = torch.tensor([lw.get(lv, 0.0) / count[lv] for lv in levels], dtype=torch.float64)
        log.info("dit: batch level weights %s", lw)
    for name in trained:
        getattr(pipe, name).train()
    bar = _progress(budget.seconds, "dit")
    bar.update(int(elapsed))
    ema_loss = None
    t_last = time.time()
    n = len(prompts)
    while not budget.done(step):
        frac = budget.fraction(step)
        warm = min(1.0, (step - restart_step + 1) / args.warmup)
        # constant LR, cosine decay to 10% over the last 30% of the budget
        cool = 1.0 if frac < 0.7 else 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (frac - 0.7) / 0.3))
        lr = args.lr * warm * cool
        for g in opt.param_groups:
            g["lr"] = lr
        idx = torch.randint(0, n, (args.batch,)) if weights is None else torch.multinomial(weights, args.batch, True)
        batch_prompts = [prompts[i] if random.random() >= args.drop else "" for i in idx.tolist()]
        x = x0[idx]  # (B, C, H, W) images or (B, C, F, H, W) videos
        cond = conditioning(batch_prompts)
        sigma = torch.sigmoid(torch.randn(args.batch))  # logit-normal(0, 1), as SD3
        eps = torch.randn_like(x)
        s = sigma.view(-1, *[1] * (x.ndim - 1))
        xs = (1 - s) * x + s * eps
        v = pipe.transformer(hidden_states=xs, timestep=1000 * sigma, **cond, return_dict=False)[0]
        loss = F.mse_loss(v.float(), (eps - x).float())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        ema.update(step)
        step += 1
        ema_loss = loss.item() if ema_loss is None else 0.98 * ema_loss + 0.02 * loss.item()
        bar.n = int(budget.elapsed)
        bar.set_postfix_str(f"step {step} loss {ema_loss:.4f} lr {lr:.1e}", refresh=False)
        bar.update(0)
        if step % 25 == 0:
            dt = (time.time() - t_last) / 25
            t_last = time.time()
            log.info("dit step %d loss %.4f gnorm %.2f lr %.2e %.2fs/step elapsed %.1fmin", step, ema_loss, gn,
                     lr, dt, budget.elapsed / 60)
        if step % args.save_every == 0:
            save_ckpt(stage, step, _dit_weights(pipe, trained, ema, names_params),
                      _stage_state(opt, step, budget, restart_step=restart_step))
    bar.close()
    save_ckpt(stage, step, _dit_weights(pipe, trained, ema, names_params),
              _stage_state(opt, step, budget, restart_step=restart_step))
    (stage / "DONE").write_text(json.dumps({"step": step, "minutes": budget.elapsed / 60}) + "\n")
    log.info("dit: done, %d steps in %.1f min", step, budget.elapsed / 60)
    return ema


# --------------------------------------------------------------------------------------------------
# Export, samples, evaluation
# --------------------------------------------------------------------------------------------------


def sampling_defaults(args, max_seq: int) -> dict:
    return {"family": "sd3", "height": IMAGE_SIZE, "width": IMAGE_SIZE, "num_frames": None,
            "guidance_scale": args.cfg, "num_steps": args.sample_steps, "max_sequence_length": max_seq,
            "shift": 1.0}


@torch.no_grad()
def sample(pipe, prompts: list[str], defaults: dict, seed: int, batch: int = 32) -> list:
    images = []
    for i in range(0, len(prompts), batch):
        g = torch.Generator().manual_seed(seed + i)
        out = pipe(prompts[i : i + batch], num_inference_steps=defaults["num_steps"],
                   guidance_scale=defaults["guidance_scale"], height=defaults["height"], width=defaults["width"],
                   max_sequence_length=defaults["max_sequence_length"], generator=g)
        images += out.images
    return images


def grid(images: list, prompts_cols: int = 8):
    from PIL import Image

    w, h = images[0].size
    rows = math.ceil(len(images) / prompts_cols)
    g = Image.new("RGB", (prompts_cols * w, rows * h), (255, 255, 255))
    for i, im in enumerate(images):
        g.paste(im, ((i % prompts_cols) * w, (i // prompts_cols) * h))
    return g


def export(pipe, ema: EMA, args, max_seq: int, folder: Path) -> None:
    from diffusers import StableDiffusion3Pipeline

    ema.copy_to()
    for name in TRAINED:
        getattr(pipe, name).eval().requires_grad_(False)
    tmp = folder.with_name(folder.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    pipe.save_pretrained(tmp, safe_serialization=True)
    from pipelines.tiny import write_sampling_defaults

    write_sampling_defaults(tmp, **sampling_defaults(args, max_seq))
    # keep a hand-written model card and sample grid if they are already there
    if folder.exists():
        for keep in ("README.md", "samples.png"):
            if (folder / keep).is_file() and not (tmp / keep).exists():
                shutil.copy2(folder / keep, tmp / keep)
        shutil.rmtree(folder)
    os.replace(tmp, folder)
    again = StableDiffusion3Pipeline.from_pretrained(folder)  # the folder must reload as-is
    del again
    size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
    log.info("export: %s (%.1f MB)", folder, size / 2**20)


REPO = Path(__file__).resolve().parent.parent


def heldout_tasks(level: str, n: int) -> tuple[list, str]:
    """The first ``n`` tasks of the shipped validation split ``assets/vvr/<level>/validation.jsonl``
    (the test split is read once per reported result, not while building a model)."""
    from rewards.vvr import load_split

    return load_split(level, "validation", n), f"assets/vvr/{level}/validation.jsonl"


def evaluate(folder: Path, n: int, seed: int = 0, grid_path: Path | None = None) -> dict:
    """Verifier accuracy of samples at the folder's ``flowalign.json`` settings on held-out tasks.

    Per level: ``all_correct`` (every constraint passes), ``constraints`` (mean pass rate),
    ``colour`` (every object colour of the task is among the detected colours).
    """
    from diffusers import StableDiffusion3Pipeline

    from rewards.vvr.verify import verify

    pipe = StableDiffusion3Pipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    defaults = json.loads((folder / "flowalign.json").read_text())
    results, rows = {}, []
    for level in ("easy", "medium", "hard"):
        tasks, source = heldout_tasks(level, n)
        t0 = time.time()
        images = sample(pipe, [t.prompt for t in tasks], defaults, seed)
        verdicts = [verify(t, im) for t, im in zip(tasks, images)]
        colour = [set(o.colour for o in t.objects) <= set(d["colour"] for d in v.detected)
                  for t, v in zip(tasks, verdicts)]
        results[level] = {
            "n": len(tasks),
            "source": source,
            "all_correct": float(np.mean([v.all_passed for v in verdicts])),
            "constraints": float(np.mean([np.mean([p for _, p in v.constraints]) for v in verdicts])),
            "colour": float(np.mean(colour)),
            "seconds": round(time.time() - t0, 1),
        }
        log.info("eval %s: %s", level, results[level])
        rows.append(images[:8])
    results["settings"] = defaults
    if grid_path is not None:
        grid([im for row in rows for im in row]).save(grid_path)
    return results


def continue_from(folder: Path, data: dict, args, out: Path):
    """Stage 4 (and, with ``--dec-minutes``, stage 3b) from a pretrained folder: its VAE encodes the new
    scenes with its own latent factors, its tokenizers stay, its transformer (deepened with
    ``--num-layers``) and text encoders keep training, its decoder optionally too. Resumable like the
    from-scratch path (the DiT stage's checkpoints hold every trained weight, the deepened transformer's
    included)."""
    from diffusers import StableDiffusion3Pipeline

    pipe = StableDiffusion3Pipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    if args.num_layers and args.num_layers != pipe.transformer.config.num_layers:
        log.info("deepening the transformer %d -> %d joint blocks (new blocks start as the identity)",
                 pipe.transformer.config.num_layers, args.num_layers)
        pipe.transformer = deepen_transformer(pipe.transformer, args.num_layers)
    for name in ("transformer", "vae", "text_encoder", "text_encoder_2", "text_encoder_3"):
        log.info("  %-15s %8.3fM params", name, sum(p.numel() for p in getattr(pipe, name).parameters()) / 1e6)
    pipe.vae.requires_grad_(False)
    x0 = encode_latents(pipe, data, out, keep_factors=True)
    # the encoder stays frozen, so the latents (and the transformer trained on them) keep their meaning
    finetune_decoder(pipe, data, x0, args, out)
    max_seq = json.loads((folder / "flowalign.json").read_text())["max_sequence_length"]
    return pipe, train_dit(pipe, data, x0, args, out, max_seq), max_seq


# --------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    # --family wan: the Wan-format text-to-video model (scripts/pretrain_tiny_wan.py, its own options)
    fam = argparse.ArgumentParser(add_help=False)
    fam.add_argument("--family", choices=("sd3", "wan"), default="sd3")
    family, argv = fam.parse_known_args(sys.argv[1:] if argv is None else argv)
    if family.family == "wan":
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from pretrain_tiny_wan import main as wan_main

        return wan_main(argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--family", choices=("sd3", "wan"), default="sd3",
                   help="sd3 (this text-to-image model) or wan (tiny text-to-video: see pretrain_tiny_wan.py)")
    p.add_argument("--out", default="runs/pretrain-tiny", help="work folder (caches, checkpoints, log)")
    p.add_argument("--export", default="assets/tiny-sd3-vvr", help="final diffusers folder")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoints in --out")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--synthetic", action="store_true", help="own coloured-shape data instead of rewards.vvr")
    p.add_argument("--n-scenes", type=int, default=30000)
    p.add_argument("--mix", default="easy:0.45,medium:0.4,hard:0.15")
    p.add_argument("--clip-max-length", type=int, default=48, help="CLIP tokenizer length (0: longest prompt)")
    p.add_argument("--max-sequence-length", type=int, default=None, help="T5 length (default: as CLIP)")
    # VAE
    p.add_argument("--vae-minutes", type=float, default=10.0)
    p.add_argument("--vae-steps", type=int, default=None)
    p.add_argument("--vae-batch", type=int, default=32)
    p.add_argument("--vae-lr", type=float, default=2e-3)
    p.add_argument("--vae-lr2", type=float, default=3e-4)
    p.add_argument("--vae-kl", type=float, default=1e-4, help="KL weight (per-pixel normalised)")
    p.add_argument("--fg-weight", type=float, default=5.0, help="loss weight of object pixels vs background")
    p.add_argument("--dec-minutes", type=float, default=None,
                   help="decoder-only fine-tuning (stage 3b; default 5 from scratch, none with --init-from)")
    p.add_argument("--dec-steps", type=int, default=None)
    p.add_argument("--dec-lr", type=float, default=1e-3)
    p.add_argument("--dec-batch", type=int, default=16)
    p.add_argument("--dec-noise", type=float, default=0.05, help="std of noise on normalised latents")
    p.add_argument("--vae-crop", type=int, default=32, help="crop size in the first LR stage (0: full images)")
    # DiT
    p.add_argument("--dit-minutes", type=float, default=30.0)
    p.add_argument("--dit-steps", type=int, default=None)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--wd", type=float, default=0.01)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--ema", type=float, default=0.995)
    p.add_argument("--dit-level-weights", default=None,
                   help="batch sampling weights per level, e.g. easy:0.6,medium:0.3,hard:0.1 (default: as rendered)")
    p.add_argument("--drop", type=float, default=0.1, help="empty-prompt rate for CFG")
    p.add_argument("--pooled-drop", type=float, default=0.0,
                   help="rate at which only the pooled text vector is replaced by the empty prompt's, so the "
                        "transformer learns to read the prompt's tokens (multi-object binding)")
    p.add_argument("--save-every", type=int, default=200)
    # sampling defaults written to flowalign.json, eval
    p.add_argument("--cfg", type=float, default=3.0, help="CFG scale written to flowalign.json (swept: 3 best)")
    p.add_argument("--sample-steps", type=int, default=20)
    p.add_argument("--eval-n", type=int, default=0, help="held-out tasks per level to verify after export")
    p.add_argument("--demo-n", type=int, default=16, help="training prompts sampled into OUT/samples_train_prompts.png")
    p.add_argument("--eval-only", action="store_true", help="only evaluate the --export folder")
    p.add_argument("--init-from", default=None,
                   help="continue from a pretrained folder (e.g. assets/tiny-sd3-vvr): its VAE and tokenizers "
                        "are kept as they are (no VAE stages), the transformer and text encoders train on "
                        "freshly rendered scenes")
    p.add_argument("--num-layers", type=int, default=None,
                   help="with --init-from: deepen the transformer to this many joint blocks (a multiple of its "
                        "own), the new ones starting as the identity")
    args = p.parse_args(argv)

    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for h in list(log.handlers):
        log.removeHandler(h)
        h.close()
    fmt = logging.Formatter("%(asctime)s %(message)s")
    for h in (logging.FileHandler(out / "train.log"), logging.StreamHandler(sys.stderr)):
        h.setFormatter(fmt)
        log.addHandler(h)
    log.setLevel(logging.INFO)
    log.propagate = False
    import diffusers.utils.logging as dlog
    import transformers.utils.logging as tlog

    dlog.set_verbosity_error()  # no per-step CLIP truncation warnings for the few over-long hard prompts
    tlog.set_verbosity_error()
    if args.dec_minutes is None:
        args.dec_minutes = 0.0 if args.init_from else 5.0
    log.info("args: %s", vars(args))
    t_start = time.time()
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    if args.eval_only:
        folder = Path(args.export)
        res = evaluate(folder, args.eval_n or 200, seed=0, grid_path=out / "samples_heldout.png")
        (out / "eval.json").write_text(json.dumps(res, indent=2) + "\n")
        print(json.dumps(res, indent=2))
        return

    # 1. data
    data_path = out / "data.pt"
    if data_path.is_file():
        data = torch.load(data_path, weights_only=False)
        log.info("data: %d cached scenes", len(data["prompts"]))
    else:
        t0 = time.time()
        data = build_dataset(args.n_scenes, parse_mix(args.mix), args.seed, args.synthetic)
        tmp = data_path.with_suffix(".tmp")
        torch.save(data, tmp)
        os.replace(tmp, data_path)
        log.info("data: rendered %d scenes in %.1f min", len(data["prompts"]), (time.time() - t0) / 60)

    if args.init_from:
        pipe, ema, max_seq = continue_from(Path(args.init_from), data, args, out)
        folder = Path(args.export)
        export(pipe, ema, args, max_seq, folder)
        log.info("total wall time %.1f min", (time.time() - t_start) / 60)
        if args.eval_n:
            res = evaluate(folder, args.eval_n, seed=0, grid_path=out / "samples_heldout.png")
            (out / "eval.json").write_text(json.dumps(res, indent=2) + "\n")
        return

    from pipelines.tiny import build_tiny_sd3, clip_tokenizer

    words = vocabulary(data["prompts"])
    clip_len = args.clip_max_length
    if not clip_len:
        tok = clip_tokenizer(16384, 1000)
        longest = max(len(tok(p).input_ids) for p in data["prompts"][:: max(1, len(data["prompts"]) // 5000)])
        clip_len = int(math.ceil((longest + 4) / 8) * 8)
    max_seq = args.max_sequence_length or clip_len
    log.info("clip_max_length %d, max_sequence_length %d, %d prompt words", clip_len, max_seq, len(words))
    pipe = build_tiny_sd3(**model_overrides(words, clip_len, max_seq))
    pipe.set_progress_bar_config(disable=True)
    for name in ("transformer", "vae", "text_encoder", "text_encoder_2", "text_encoder_3"):
        n = sum(p.numel() for p in getattr(pipe, name).parameters())
        log.info("  %-15s %8.3fM params", name, n / 1e6)

    # 2-3. VAE + latents
    train_vae(pipe, data, args, out)
    pipe.vae.requires_grad_(False)
    x0 = encode_latents(pipe, data, out)
    finetune_decoder(pipe, data, x0, args, out)

    # 4. transformer + text encoders
    ema = train_dit(pipe, data, x0, args, out, max_seq)

    # 5. export
    folder = Path(args.export)
    export(pipe, ema, args, max_seq, folder)
    defaults = sampling_defaults(args, max_seq)
    from diffusers import StableDiffusion3Pipeline

    shipped = StableDiffusion3Pipeline.from_pretrained(folder)
    shipped.set_progress_bar_config(disable=True)
    if args.demo_n:
        rng = random.Random(12345)
        demo = [data["prompts"][i] for i in rng.sample(range(len(data["prompts"])), args.demo_n)]
        imgs = sample(shipped, demo, defaults, seed=0)
        grid(imgs).save(out / "samples_train_prompts.png")
        with open(out / "samples_train_prompts.txt", "w") as f:
            f.write("\n".join(demo) + "\n")
    log.info("total wall time %.1f min", (time.time() - t_start) / 60)

    # 6. eval
    if args.eval_n:
        res = evaluate(folder, args.eval_n, seed=0, grid_path=out / "samples_heldout.png")
        (out / "eval.json").write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
