"""Pretrain the embedded tiny Wan-format text-to-video model on rendered motion clips, on one CPU core.

``scripts/pretrain_tiny.py --family wan ...`` runs this file (so does ``python scripts/pretrain_tiny_wan.py``).
The shipped ``assets/tiny-wan-motion`` (an f_s 2 VAE with z 4 and a patch-(1, 4, 4) DiT; 74 % of held-out
easy motion tasks) runs these stages; its README.md has the exact commands (the decoder stage ran beside the
DiT in a copy of the run folder), data and accuracies. From scratch, one command:

    .venv/bin/python scripts/pretrain_tiny.py --family wan --out runs/wan-f2 --export assets/tiny-wan-motion \
        --n-clips 8000 --vae-dim-mult 1,2 --z-dim 4 --patch 1,4,4 \
        --vae-minutes 25 --dit-minutes 50 --dec-minutes 30 --eval-n 200

Stages (each resumable; ``--resume`` continues from the newest complete checkpoint of the stage it was
in, and a finished stage is never redone), the SD3 script's recipe carried over to video:

1. data     render ``--n-clips`` motion tasks of ``rewards.vvr_motion`` once (task seeds < 1000; the
            benchmark splits use 2001-2003) as 9-frame 32 px clips into a uint8 cache, a mixture of
            levels (``--mix easy:0.7,medium:0.3``: one object moving one way first, some medium).
2. vae      ``AutoencoderKLWan`` (Wan 2.1's causal 3D VAE, tiny: f_s 2, f_t 2, 9×32×32 px ->
            4×5×16×16) on random 5-frame windows of the clips (a causal VAE sees a window as a clip;
            5 frames cost half of 9), foreground-weighted L1 + MSE + small KL on the *unclamped*
            decoder output (see ``decode_unclamped``), high then low LR;
            then per-channel ``latents_mean`` / ``latents_std`` from the latent statistics.
3. latents  encode every clip once (posterior mean), normalised as ``WanPipeline`` expects:
            ``x0 = (z - latents_mean) / latents_std``.
4. dit      ``WanTransformer3DModel`` + the UMT5 text encoder (word-level tokenizer of
            ``pipelines.tiny``) trained jointly with the rectified-flow loss of conventions.md:
            ``x_σ = (1-σ)x0 + σε``, target ``v = ε - x0``, ``timestep = 1000σ``, σ logit-normal(0, 1);
            10% of prompts dropped to "" (the pipeline's CFG negative). Text embeddings come from
            ``pipe.encode_prompt`` itself (grad enabled), so training sees what inference feeds. AdamW, EMA.
5. decoder  decoder-only fine-tuning on the cached latents (encoder frozen, so the latents and the
            transformer stay valid), whole 9-frame clips: lifted the verifier's VAE ceiling on easy
            clips from 8 % to 44 % in 11 min.
6. export   a diffusers folder with the EMA weights (``WanPipeline.from_pretrained`` opens it offline;
            ``FlowMatchEulerDiscreteScheduler``, which ``WanPipeline`` and ``pipelines.wan`` step as is),
            ``flowalign.json`` sampling defaults and a sample strip + GIF of training prompts.
7. eval     (optional, ``--eval-n``) the exact ``flowalign evaluate --bench vvr_motion`` code path
            (``pipelines.load`` + ``flowalign.evaluation.evaluate``) on the held-out easy / medium splits.

The VAE starts *inflated* (``inflate_``: a per-frame autoencoder) and trains on the *unclamped* decoder
output (``decode_unclamped``); both were needed for it to learn at all in CPU minutes (docs/video.md).

Checkpoints: ``OUT/<stage>/step-XXXXXX/`` (weights as safetensors, optimiser/RNG/progress as a torch
file), written to a temp folder and renamed; only the newest two are kept (helpers shared with the SD3
script).
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
# on shared cores, spinning OpenMP workers stall whenever a sibling thread is descheduled
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import torch  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from pretrain_tiny import (  # noqa: E402  (checkpoint, budget, EMA and DiT-stage code shared with the SD3 path)
    EMA,
    Budget,
    _fg_weight,
    _load_prefixed,
    _progress,
    _set_rng_state,
    _stage_state,
    _tensors,
    latest_ckpt,
    load_ckpt,
    parse_mix,
    save_ckpt,
    train_dit,
    vocabulary,
)

log = logging.getLogger("pretrain_tiny_wan")

# --------------------------------------------------------------------------------------------------
# The shipped architecture (overrides for pipelines.tiny.build_tiny_wan)
# --------------------------------------------------------------------------------------------------

SIZE = 32  # px; the motion verifier passes every rendered easy / medium clip at 32 px
NUM_FRAMES = 9  # rewards.vvr_motion's clip length (Wan's VAE takes 4k + 1 frames)
VAE_WINDOW = 5  # frames per VAE training clip (1 + 4: one causal chunk after the first frame)


def model_overrides(words: list[str], max_length: int, *, vae_dim_mult: tuple[int, ...] = (1, 2),
                    z_dim: int = 4, patch: tuple[int, int, int] = (1, 4, 4)) -> dict:
    """Wan 2.1 T2V-like DiT (cross-attention to UMT5, 3-axis RoPE, qk RMS-norm across heads), 4 layers ×
    width 128 (4 heads × 32); causal 3D VAE with f_t = 2 (the last level halves time), f_s =
    2^(levels - 1); UMT5 stand-in (width 64, word-level vocabulary incl. every training word).
    Defaults (the shipped model): f_s 2, z 4, patch (1, 4, 4) on 4×5×16×16 latents = 80 tokens. The first
    version, ``vae_dim_mult=(1, 2, 2), z_dim=8, patch=(1, 2, 2)`` (f_s 4, 8×5×8×8 latents, also 80 tokens),
    blurred 6-11 px objects: its VAE ceiling on easy clips was 44 % (no star survived) against 100 %."""
    temporal = [False] * (len(vae_dim_mult) - 2) + [True]
    return dict(
        seed=0,
        t5_max_length=max_length,
        t5_extra_words=tuple(words),
        transformer=dict(patch_size=list(patch), num_attention_heads=4, attention_head_dim=32, freq_dim=64,
                         ffn_dim=512, num_layers=4, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
                         rope_max_seq_len=64),
        vae=dict(base_dim=12, z_dim=z_dim, dim_mult=list(vae_dim_mult), num_res_blocks=1, attn_scales=[],
                 temperal_downsample=temporal),
        text_encoder=dict(d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
                          relative_attention_num_buckets=16, relative_attention_max_distance=64),
        scheduler=dict(shift=1.0),
    )


# --------------------------------------------------------------------------------------------------
# Stage 1: data
# --------------------------------------------------------------------------------------------------


def build_dataset(n: int, mix: dict[str, float], seed: int) -> dict:
    """Render ``n`` training clips once: uint8 ``(N, 3, F, H, W)`` (the VAE's layout), prompts, levels."""
    from tqdm import tqdm

    from rewards.vvr_motion import generate_tasks, render

    clips: list[np.ndarray] = []
    prompts: list[str] = []
    levels: list[str] = []
    for i, (level, w) in enumerate(mix.items()):
        k = int(round(n * w)) if i < len(mix) - 1 else n - len(clips)
        task_seed = seed * 10 + i  # training seeds < 1000 (the benchmark splits use 2001-2003)
        if task_seed >= 1000:
            raise ValueError(f"--seed {seed} gives task seed {task_seed} >= 1000 (reserved for benchmarks)")
        for t in tqdm(generate_tasks(k, seed=task_seed, level=level, num_frames=NUM_FRAMES),
                      desc=f"render {level}", mininterval=5):
            clips.append(render(t, size=SIZE))  # (F, H, W, 3)
            prompts.append(t.prompt)
            levels.append(level)
    arr = torch.from_numpy(np.stack(clips)).permute(0, 4, 1, 2, 3).contiguous()
    return {"clips": arr, "prompts": prompts, "levels": levels}


def _pixels(clips: torch.Tensor) -> torch.Tensor:
    """uint8 clips → float in [-1, 1] (the VAE's input range)."""
    return clips.float() / 127.5 - 1.0


# --------------------------------------------------------------------------------------------------
# Stage 2: VAE
# --------------------------------------------------------------------------------------------------


@torch.no_grad()
def inflate_(vae) -> None:
    """Start the causal 3D VAE as a per-frame image autoencoder [derived; the usual 2D → 3D "inflation"]:
    every causal conv's past taps are zero (only the current frame counts), the encoder's temporal
    downsampling keeps the last frame of each pair and the decoder's temporal upsampling repeats the
    current frame twice. Past taps stay trainable, so video training then learns the temporal mixing
    (in-between frames); a random init instead mixes random past features into every frame, and 340
    steps from it reconstructed no clip the verifier passes."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d, WanResample

    time_convs = set()
    for m in vae.modules():
        if isinstance(m, WanResample) and hasattr(m, "time_conv"):
            tc = m.time_conv
            time_convs.add(id(tc))
            c = tc.in_channels
            tc.weight.zero_()
            tc.bias.zero_()
            eye = torch.eye(c)
            tc.weight[:c, :, -1, 0, 0] = eye  # downsample: (c → c); upsample: first of the two frames
            if tc.out_channels == 2 * c:  # upsample3d: the second frame too
                tc.weight[c:, :, -1, 0, 0] = eye
    for m in vae.modules():
        if isinstance(m, WanCausalConv3d) and id(m) not in time_convs and m.kernel_size[0] > 1:
            m.weight[:, :, :-1] = 0


def decode_unclamped(vae, z: torch.Tensor) -> torch.Tensor:
    """``AutoencoderKLWan._decode`` (frame by frame through the causal cache) without its final clamp
    to [-1, 1]: clamped outputs pass no gradient, and a freshly initialised decoder that starts near
    white never learns the objects' colours (measured: loss flat at 0.65 with the clamp, 0.43 and
    falling without it after 120 steps) [derived]."""
    vae.clear_cache()
    x = vae.post_quant_conv(z)
    frames = []
    for i in range(z.shape[2]):
        vae._conv_idx = [0]
        frames.append(vae.decoder(x[:, :, i : i + 1], feat_cache=vae._feat_map, feat_idx=vae._conv_idx,
                                  first_chunk=i == 0))
    vae.clear_cache()
    return torch.cat(frames, 2)


def train_vae(pipe, data: dict, args, out: Path) -> None:
    vae = pipe.vae
    stage = out / "vae"
    if (stage / "DONE").is_file():
        w, st = load_ckpt(latest_ckpt(stage))
        _load_prefixed(vae, w, "vae")
        if not (args.resume and not Budget(args.vae_minutes, args.vae_steps, st["elapsed"]).done(st["step"])):
            return
        # continuation with a larger budget: the latents and everything trained on them are stale
        (stage / "DONE").unlink()
        for stale in ("latents.pt", "dit", "decoder"):
            path = out / stale
            if path.is_dir():
                shutil.move(path, out / f"{stale}.stale-{int(time.time())}")
            elif path.exists():
                path.unlink()
        log.info("vae: continuing a finished stage at step %d up to %s min; latents, dit, decoder redone",
                 st["step"], args.vae_minutes)
    clips = data["clips"]
    inflate_(vae)
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
        # high rate, then a cosine down to the low rate over the last 30% (a single high rate leaves colour shifts)
        cool = 1.0 if frac < 0.7 else 0.5 * (1 + math.cos(math.pi * (frac - 0.7) / 0.3))
        lr = (args.vae_lr2 + (args.vae_lr - args.vae_lr2) * cool) * min(1.0, (step + 1) / 20)
        for g in opt.param_groups:
            g["lr"] = lr
        idx = torch.randint(0, len(clips), (args.vae_batch,))
        start = int(torch.randint(0, NUM_FRAMES - VAE_WINDOW + 1, (1,)))
        x = _pixels(clips[idx, :, start : start + VAE_WINDOW])  # (B, 3, 5, H, W)
        post = vae.encode(x).latent_dist
        rec = decode_unclamped(vae, post.sample())
        kl = post.kl().mean() / x[0].numel()
        # frames folded into the batch: the SD3 script's per-frame foreground weight
        wgt = _fg_weight(x.transpose(1, 2).flatten(0, 1), args.fg_weight).unflatten(0, (len(x), -1)).transpose(1, 2)
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
        if step % 25 == 0:
            log.info("vae step %d loss %.4f kl %.3f lr %.1e elapsed %.1fmin", step, ema_loss, kl.item(), lr,
                     budget.elapsed / 60)
        if step % args.save_every == 0:
            save_ckpt(stage, step, _tensors("vae", vae), _stage_state(opt, step, budget))
    bar.close()
    vae.eval()
    save_ckpt(stage, step, _tensors("vae", vae), _stage_state(opt, step, budget))
    (stage / "DONE").write_text(json.dumps({"step": step, "minutes": budget.elapsed / 60}) + "\n")
    log.info("vae: done, %d steps in %.1f min", step, budget.elapsed / 60)


@torch.no_grad()
def encode_latents(pipe, data: dict, out: Path, batch: int = 64) -> torch.Tensor:
    """Posterior means of every clip ``(N, z, 5, 16, 16)``; sets the VAE's per-channel ``latents_mean`` /
    ``latents_std`` from their statistics and returns the normalised latents."""
    path = out / "latents.pt"
    vae = pipe.vae.eval()
    if path.is_file():
        cache = torch.load(path)
        vae.register_to_config(latents_mean=cache["latents_mean"], latents_std=cache["latents_std"])
        return cache["x0"]
    from tqdm import tqdm

    clips = data["clips"]
    zs = [vae.encode(_pixels(clips[i : i + batch])).latent_dist.mean
          for i in tqdm(range(0, len(clips), batch), desc="encode latents", mininterval=10)]
    z = torch.cat(zs)
    mean = z.transpose(0, 1).flatten(1).mean(1)
    std = z.transpose(0, 1).flatten(1).std(1)
    vae.register_to_config(latents_mean=[round(float(v), 5) for v in mean],
                           latents_std=[round(float(v), 5) for v in std])
    mean_t = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    std_t = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    x0 = (z - mean_t) / std_t
    rec = vae.decode(z[:32]).sample
    err = (rec - _pixels(clips[:32])).abs().mean().item() * 127.5
    log.info("latents: %s mean %s std %s; recon MAE %.2f/255", tuple(z.shape), vae.config.latents_mean,
             vae.config.latents_std, err)
    tmp = path.with_suffix(".tmp")
    torch.save({"x0": x0, "latents_mean": vae.config.latents_mean, "latents_std": vae.config.latents_std}, tmp)
    os.replace(tmp, path)
    return x0


def finetune_decoder(pipe, data: dict, x0: torch.Tensor, args, out: Path) -> None:
    """Stage 5: decoder-only fine-tuning on the cached latents, whole 9-frame clips (encoder frozen, so the
    latents and the transformer trained on them stay valid), foreground-weighted L1 + MSE, cosine LR to
    zero, small latent noise for robustness to imperfect samples (the SD3 script's stage 3b)."""
    if not args.dec_minutes and not args.dec_steps:
        return
    vae = pipe.vae
    stage = out / "decoder"
    done = (stage / "DONE").is_file()
    if done:
        w, st = load_ckpt(latest_ckpt(stage))
        _load_prefixed(vae, w, "vae")
        if not (args.resume and not Budget(args.dec_minutes, args.dec_steps, st["elapsed"]).done(st["step"])):
            return
        # continuation with a larger budget: the encoder is frozen, so the latents and the DiT stay valid;
        # the cosine restarts from where the longer budget puts it
        (stage / "DONE").unlink()
        log.info("decoder: continuing a finished stage at step %d up to %s min", st["step"], args.dec_minutes)
    dec = [vae.decoder, vae.post_quant_conv]
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
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    for p in params:
        p.requires_grad_(True)
    for m in dec:
        m.train()
    clips = data["clips"]
    bar = _progress(budget.seconds, "decoder")
    bar.update(int(elapsed))
    ema_loss = None
    while not budget.done(step):
        frac = budget.fraction(step)
        lr = args.dec_lr * 0.5 * (1 + math.cos(math.pi * frac)) * min(1.0, (step + 1) / 20)
        for g in opt.param_groups:
            g["lr"] = lr
        idx = torch.randint(0, len(clips), (args.vae_batch,))
        x = _pixels(clips[idx])
        z = (x0[idx] + args.dec_noise * torch.randn_like(x0[idx])) * std + mean
        rec = decode_unclamped(vae, z)
        wgt = _fg_weight(x.transpose(1, 2).flatten(0, 1), args.fg_weight).unflatten(0, (len(x), -1)).transpose(1, 2)
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
        if step % 25 == 0:
            log.info("decoder step %d loss %.4f lr %.1e elapsed %.1fmin", step, ema_loss, lr, budget.elapsed / 60)
        if step % args.save_every == 0:
            save_ckpt(stage, step, _tensors("vae", vae), _stage_state(opt, step, budget))
    bar.close()
    vae.eval().requires_grad_(False)
    save_ckpt(stage, step, _tensors("vae", vae), _stage_state(opt, step, budget))
    (stage / "DONE").write_text(json.dumps({"step": step, "minutes": budget.elapsed / 60}) + "\n")
    log.info("decoder: done, %d steps in %.1f min", step, budget.elapsed / 60)


# --------------------------------------------------------------------------------------------------
# Stage 4: transformer + text encoder
# --------------------------------------------------------------------------------------------------

TRAINED = ("transformer", "text_encoder")


def wan_conditioning(pipe, max_seq: int) -> Callable[[list[str]], dict[str, torch.Tensor]]:
    """``prompts → transformer kwargs`` for Wan: the UMT5 token states from ``pipe.encode_prompt`` (with
    gradients on, so training sees exactly what inference feeds the transformer)."""

    def encode(prompts: list[str]) -> dict[str, torch.Tensor]:
        embeds, _ = pipe.encode_prompt(prompt=prompts, do_classifier_free_guidance=False,
                                       max_sequence_length=max_seq, device=torch.device("cpu"))
        return {"encoder_hidden_states": embeds}

    return encode


# --------------------------------------------------------------------------------------------------
# Export, samples, evaluation
# --------------------------------------------------------------------------------------------------


def sampling_defaults(args, max_seq: int) -> dict:
    return {"family": "wan", "height": SIZE, "width": SIZE, "num_frames": NUM_FRAMES,
            "guidance_scale": args.cfg, "num_steps": args.sample_steps, "max_sequence_length": max_seq,
            "shift": args.shift}


def export(pipe, ema: EMA, args, max_seq: int, folder: Path) -> None:
    from diffusers import WanPipeline

    from pipelines.tiny import write_sampling_defaults

    ema.copy_to()
    for name in TRAINED:
        getattr(pipe, name).eval().requires_grad_(False)
    tmp = folder.with_name(folder.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    pipe.save_pretrained(tmp, safe_serialization=True)
    write_sampling_defaults(tmp, **sampling_defaults(args, max_seq))
    # keep a hand-written model card and samples if they are already there
    if folder.exists():
        for keep in ("README.md", "samples.png", "samples.gif"):
            if (folder / keep).is_file() and not (tmp / keep).exists():
                shutil.copy2(folder / keep, tmp / keep)
        shutil.rmtree(folder)
    os.replace(tmp, folder)
    again = WanPipeline.from_pretrained(folder)  # the folder must reload as-is
    del again
    size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
    log.info("export: %s (%.1f MB)", folder, size / 2**20)


def save_strip(videos: torch.Tensor, png: Path, gif: Path | None = None, cols: int = 4) -> None:
    """``(N, F, 3, H, W)`` in [0, 1] → a PNG (one row per clip, one column per frame) and a GIF
    (the clips tiled ``cols`` wide, playing together)."""
    from PIL import Image

    v = (videos.clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 1, 3, 4, 2).numpy()  # (N, F, H, W, 3)
    n, f, h, w, _ = v.shape
    Image.fromarray(np.concatenate([np.concatenate(list(clip), axis=1) for clip in v], axis=0)).save(png)
    if gif is not None:
        rows = math.ceil(n / cols)
        pad = np.full((rows * cols - n, f, h, w, 3), 255, np.uint8)
        tiles = np.concatenate([v, pad]).reshape(rows, cols, f, h, w, 3)
        frames = tiles.transpose(2, 0, 3, 1, 4, 5).reshape(f, rows * h, cols * w, 3)
        frames = np.repeat(np.repeat(frames, 2, axis=1), 2, axis=2)  # 2× so a 32 px clip is visible
        Image.fromarray(frames[0]).save(gif, save_all=True, append_images=[Image.fromarray(x) for x in frames[1:]],
                                        duration=125, loop=0)


def evaluate_levels(folder: Path, n: int, out: Path, levels: tuple[str, ...] = ("easy", "medium")) -> dict:
    """``flowalign evaluate --bench vvr_motion --level L --n n`` for each level, same code path."""
    import pipelines
    from flowalign.evaluation import evaluate
    from rewards.benchmarks import load_benchmark

    policy = pipelines.load(str(folder))
    results = {}
    for level in levels:
        bench = load_benchmark("vvr_motion", level, n, split="validation")
        t0 = time.time()
        m = evaluate(policy, bench.prompts, bench.metadata, bench.reward, seed=0, batch_size=16,
                     out_dir=out / f"eval-{level}", progress=False)
        results[level] = {"n": m["n"], "accuracy": m.get("accuracy"), "mean_score": m["mean_score"],
                          "per_constraint": m.get("per_constraint"), "seconds": round(time.time() - t0, 1)}
        log.info("eval %s: %s", level, results[level])
    results["settings"] = dict(policy.defaults)
    for level in levels:
        results[level]["vae_ceiling"] = vae_ceiling(policy.pipe.vae, level, min(n, 48))
        log.info("vae ceiling %s: %s", level, results[level]["vae_ceiling"])
    return results


@torch.no_grad()
def vae_ceiling(vae, level: str, n: int) -> dict:
    """What a perfect transformer could reach through this VAE: the first ``n`` held-out clips of ``level``
    rendered, encoded (posterior mean), decoded and verified. ``shapes``: passes per named shape."""
    from rewards.benchmarks import load_benchmark
    from rewards.vvr_motion import render, verify

    bench = load_benchmark("vvr_motion", level, n, split="validation")
    passed, shapes = 0, {}
    for meta in bench.metadata:
        task = meta["task"]
        clip = torch.from_numpy(np.asarray(render(task, size=SIZE))).permute(3, 0, 1, 2)[None]
        rec = vae.decode(vae.encode(_pixels(clip)).latent_dist.mean).sample[0]
        frames = ((rec.clamp(-1, 1) + 1) * 127.5).round().byte().permute(1, 2, 3, 0).numpy()
        ok = verify(task, frames).all_passed
        passed += ok
        c = task["constraints"][0]
        shape = c.get("ref", {}).get("shape", "?")  # the first constraint's object (toward/away_from name two)
        good, total = shapes.get(shape, (0, 0))
        shapes[shape] = (good + ok, total + 1)
    return {"n": len(bench.metadata), "accuracy": passed / max(1, len(bench.metadata)),
            "shapes": {k: f"{g}/{t}" for k, (g, t) in sorted(shapes.items())}}


# --------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="runs/pretrain-wan", help="work folder (caches, checkpoints, log)")
    p.add_argument("--export", default="assets/tiny-wan-motion", help="final diffusers folder")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoints in --out")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--n-clips", type=int, default=8000)
    p.add_argument("--mix", default="easy:0.7,medium:0.3")
    p.add_argument("--max-sequence-length", type=int, default=0, help="UMT5 length (0: longest prompt + 2)")
    # VAE
    p.add_argument("--vae-dim-mult", default="1,2", help="VAE levels (spatial factor 2^(levels-1)); 1,2,2: f_s 4")
    p.add_argument("--z-dim", type=int, default=4, help="VAE latent channels")
    p.add_argument("--patch", default="1,4,4", help="DiT patch (t,h,w); 1,2,2 with --vae-dim-mult 1,2,2")
    p.add_argument("--vae-minutes", type=float, default=25.0)
    p.add_argument("--vae-steps", type=int, default=None)
    p.add_argument("--vae-batch", type=int, default=8)
    p.add_argument("--vae-lr", type=float, default=3e-3)
    p.add_argument("--vae-lr2", type=float, default=3e-4)
    p.add_argument("--vae-kl", type=float, default=1e-4, help="KL weight (per-pixel normalised)")
    p.add_argument("--fg-weight", type=float, default=5.0, help="loss weight of object pixels vs background")
    p.add_argument("--dec-minutes", type=float, default=30.0, help="decoder-only fine-tuning after the DiT")
    p.add_argument("--dec-steps", type=int, default=None)
    p.add_argument("--dec-lr", type=float, default=1e-3)
    p.add_argument("--dec-noise", type=float, default=0.05, help="std of noise on normalised latents")
    # DiT
    p.add_argument("--dit-minutes", type=float, default=50.0)
    p.add_argument("--dit-steps", type=int, default=None)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--wd", type=float, default=0.01)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--ema", type=float, default=0.995)
    p.add_argument("--dit-level-weights", default=None, help="batch sampling weights per level (default: as rendered)")
    p.add_argument("--drop", type=float, default=0.1, help="empty-prompt rate for CFG")
    p.add_argument("--save-every", type=int, default=200)
    # sampling defaults written to flowalign.json, eval
    p.add_argument("--cfg", type=float, default=4.0, help="CFG scale written to flowalign.json")
    p.add_argument("--shift", type=float, default=1.0, help="sampling shift written to flowalign.json")
    p.add_argument("--sample-steps", type=int, default=20)
    p.add_argument("--eval-n", type=int, default=0, help="held-out tasks per level (easy, medium) after export")
    p.add_argument("--demo-n", type=int, default=8, help="training prompts sampled into OUT/samples_train_prompts.*")
    p.add_argument("--eval-only", action="store_true", help="only evaluate the --export folder")
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

    dlog.set_verbosity_error()
    tlog.set_verbosity_error()
    log.info("args: %s", vars(args))
    t_start = time.time()
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    if args.eval_only:
        res = evaluate_levels(Path(args.export), args.eval_n or 200, out)
        (out / "eval.json").write_text(json.dumps(res, indent=2) + "\n")
        print(json.dumps(res, indent=2))
        return

    # 1. data
    data_path = out / "data.pt"
    if data_path.is_file():
        data = torch.load(data_path, weights_only=False)
        log.info("data: %d cached clips", len(data["prompts"]))
    else:
        t0 = time.time()
        data = build_dataset(args.n_clips, parse_mix(args.mix), args.seed)
        tmp = data_path.with_suffix(".tmp")
        torch.save(data, tmp)
        os.replace(tmp, data_path)
        log.info("data: rendered %d clips %s in %.1f min", len(data["prompts"]), tuple(data["clips"].shape[1:]),
                 (time.time() - t0) / 60)

    from pipelines.tiny import build_tiny_wan, t5_tokenizer

    words = vocabulary(data["prompts"])
    max_seq = args.max_sequence_length
    if not max_seq:
        tok = t5_tokenizer(512, tuple(words))
        max_seq = max(len(tok(p).input_ids) for p in set(data["prompts"])) + 2
    log.info("max_sequence_length %d, %d prompt words", max_seq, len(words))
    ints = lambda text: tuple(int(v) for v in text.split(","))  # noqa: E731
    pipe = build_tiny_wan(**model_overrides(words, max_seq, vae_dim_mult=ints(args.vae_dim_mult), z_dim=args.z_dim,
                                            patch=ints(args.patch)))
    pipe.set_progress_bar_config(disable=True)
    for name in ("transformer", "vae", "text_encoder"):
        n = sum(p.numel() for p in getattr(pipe, name).parameters())
        log.info("  %-15s %8.3fM params", name, n / 1e6)

    # 2-3. VAE + latents
    train_vae(pipe, data, args, out)
    pipe.vae.requires_grad_(False)
    x0 = encode_latents(pipe, data, out)

    # 4. transformer + text encoder
    ema = train_dit(pipe, data, x0, args, out, max_seq, trained=TRAINED,
                    conditioning=wan_conditioning(pipe, max_seq))

    # 5. decoder fine-tuning on the same latents (after the DiT: it does not change them)
    finetune_decoder(pipe, data, x0, args, out)

    # 6. export
    folder = Path(args.export)
    export(pipe, ema, args, max_seq, folder)
    if args.demo_n:
        import pipelines
        from flowalign.evaluation import sample_seeded

        rng = random.Random(12345)
        demo = [data["prompts"][i] for i in rng.sample(range(len(data["prompts"])), args.demo_n)]
        videos = sample_seeded(pipelines.load(str(folder)), demo, seed=0, progress=False)
        save_strip(videos, out / "samples_train_prompts.png", out / "samples_train_prompts.gif")
        (out / "samples_train_prompts.txt").write_text("\n".join(demo) + "\n")
    log.info("total wall time %.1f min", (time.time() - t_start) / 60)

    # 7. eval
    if args.eval_n:
        res = evaluate_levels(folder, args.eval_n, out)
        (out / "eval.json").write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
