"""The training data of a tiny world: benchmark scenes rendered once into a uint8 cache.

Scenes come from a benchmark's task generator and renderer through the core's registry
(:func:`flowalign.benchmarks.load_benchmark` with a training seed, :func:`flowalign.benchmarks.render_task`),
so this package never imports a concrete benchmark. Task seeds stay below 1000: the benchmarks' own
evaluation splits are drawn from seeds ≥ 1000. ``synthetic_scenes`` is a benchmark-free fallback.
"""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path

import numpy as np
import torch

from flowalign.errors import UserError
from flowalign.io import atomic_path, write_json

log = logging.getLogger("flowalign.pretrain")

#: task seeds at or above this are the benchmarks' evaluation splits, never trained on
HELD_OUT_SEEDS = 1000


def parse_mix(spec: str) -> dict[str, float]:
    """``"easy:0.45,medium:0.4"`` → level weights normalised to sum to 1."""
    out = {}
    for part in spec.split(","):
        name, _, weight = part.partition(":")
        try:
            out[name.strip()] = float(weight)
        except ValueError:
            raise UserError(f"mix {spec!r}: write level:weight pairs, e.g. easy:0.45,medium:0.4,hard:0.15") from None
    total = sum(out.values())
    if total <= 0:
        raise UserError(f"mix {spec!r}: the weights must sum to more than 0")
    return {k: v / total for k, v in out.items()}


def vocabulary(prompts: list[str]) -> list[str]:
    """Every word of the prompts (punctuation stripped), sorted: the word-level tokenizer's extra words."""
    words: dict[str, None] = {}
    for p in prompts:
        for w in p.replace(",", " ").replace(";", " ").replace(".", " ").replace(":", " ").split():
            words.setdefault(w.strip("\"'()"), None)
    return sorted(w for w in words if w)


def longest_prompt(tokenizer, prompts: list[str]) -> int:
    """The most tokens ``tokenizer`` makes of one of ``prompts``."""
    return max(len(tokenizer(p).input_ids) for p in prompts)


def level_counts(n: int, mix: dict[str, float]) -> list[tuple[str, int]]:
    """``n`` split over the levels by weight (the last level takes the rounding remainder)."""
    counts, used = [], 0
    for i, (level, weight) in enumerate(mix.items()):
        k = int(round(n * weight)) if i < len(mix) - 1 else n - used
        counts.append((level, k))
        used += k
    return counts


def task_seed(seed: int, level_index: int) -> int:
    """The task seed of the ``level_index``-th level of the mix for run seed ``seed``: ``10·seed + i``,
    refused when it reaches the benchmarks' evaluation seeds."""
    value = seed * 10 + level_index
    if value >= HELD_OUT_SEEDS:
        raise UserError(f"--seed {seed} gives task seed {value} >= {HELD_OUT_SEEDS} (reserved for benchmarks)")
    return value


def render_benchmark(bench: str, n: int, mix: dict[str, float], seed: int, size: int) -> dict:
    """``n`` freshly drawn tasks of ``bench``, level ``i`` of the mix with task seed ``10·seed + i``,
    rendered at ``size`` px: uint8 pixels ``(N, 3, H, W)`` (images) or ``(N, 3, F, H, W)`` (clips, the
    video VAE's layout), prompts and levels."""
    from tqdm import tqdm

    from flowalign.benchmarks import render_task, training_tasks

    pixels, prompts, levels = [], [], []
    for i, (level, k) in enumerate(level_counts(n, mix)):
        seed_i = task_seed(seed, i)
        if k == 0:
            continue
        split = training_tasks(bench, level, k, seed=seed_i)
        for prompt, meta in tqdm(list(zip(split.prompts, split.metadata)), desc=f"render {level}", mininterval=5):
            pixels.append((render_task(bench, meta, size) * 255).round().to(torch.uint8))
            prompts.append(prompt)
            levels.append(level)
    stacked = torch.stack(pixels)
    if stacked.ndim == 5:  # (N, F, 3, H, W) → (N, 3, F, H, W)
        stacked = stacked.transpose(1, 2)
    return {"pixels": stacked.contiguous(), "prompts": prompts, "levels": levels}


def synthetic_scenes(n: int, seed: int, size: int) -> dict:
    """Benchmark-free data: one coloured circle/square/triangle, or two side by side, on white."""
    from PIL import Image, ImageDraw

    colours = {"red": (230, 25, 35), "green": (30, 170, 50), "blue": (30, 60, 220), "yellow": (245, 210, 20),
               "purple": (140, 40, 180), "orange": (250, 130, 20)}
    shapes = ["circle", "square", "triangle"]
    rng = random.Random(seed)
    k = size / 64  # the layout is drawn for 64 px

    def draw(d: ImageDraw.ImageDraw, shape: str, col: tuple, cx: int, cy: int, r: int) -> None:
        cx, cy, r = (int(round(v * k)) for v in (cx, cy, r))
        if shape == "circle":
            d.ellipse([cx - r, cy - r, cx + r, cy + r], fill=col)
        elif shape == "square":
            d.rectangle([cx - r, cy - r, cx + r, cy + r], fill=col)
        else:
            d.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=col)

    images, prompts = [], []
    for _ in range(n):
        img = Image.new("RGB", (size, size), (255, 255, 255))
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
    pixels = torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2).contiguous()
    return {"pixels": pixels, "prompts": prompts, "levels": ["synthetic"] * n}


def cached(out: Path, build) -> dict:
    """``build()``'s data, rendered once: ``OUT/data.safetensors`` + ``OUT/data.json`` (prompts, levels)."""
    from safetensors.torch import load_file, save_file

    tensors, text = out / "data.safetensors", out / "data.json"
    if tensors.is_file() and text.is_file():
        data = {"pixels": load_file(str(tensors))["pixels"], **json.loads(text.read_text())}
        log.info("data: %d cached scenes %s", len(data["prompts"]), tuple(data["pixels"].shape[1:]))
        return data
    data = build()
    with atomic_path(tensors) as tmp:
        save_file({"pixels": data["pixels"]}, str(tmp))
    write_json(text, {"prompts": data["prompts"], "levels": data["levels"]})
    log.info("data: rendered %d scenes %s", len(data["prompts"]), tuple(data["pixels"].shape[1:]))
    return data


def to_unit(pixels: torch.Tensor) -> torch.Tensor:
    """uint8 pixels → float in [-1, 1] (the VAEs' input range)."""
    return pixels.float() / 127.5 - 1.0


def foreground_weight(x: torch.Tensor, fg: float) -> torch.Tensor:
    """Per-pixel loss weight ``(B, 1, H, W)`` of images ``x (B, 3, H, W)``: ``fg`` where a pixel differs from
    the corner (background) colour, else 1. Objects cover a few percent of a scene; without the weight
    their colours are the last thing a VAE gets right. Clips ``(B, 3, F, H, W)`` are weighted per frame."""
    if x.ndim == 5:
        frames = x.transpose(1, 2).flatten(0, 1)
        return foreground_weight(frames, fg).unflatten(0, (len(x), -1)).transpose(1, 2)
    bg = x[:, :, :1, :1]
    return 1.0 + (fg - 1.0) * ((x - bg).abs().amax(dim=1, keepdim=True) > 0.05).float()


def reconstruction_loss(rec: torch.Tensor, x: torch.Tensor, fg: float) -> torch.Tensor:
    """Foreground-weighted L1 + MSE of a reconstruction ``rec`` of ``x`` (both in [-1, 1])."""
    wgt = foreground_weight(x, fg)
    return (wgt * ((rec - x).abs() + (rec - x) ** 2)).mean() / wgt.mean()


def level_sampling_weights(levels: list[str], spec: str | None) -> torch.Tensor | None:
    """Per-item sampling weights that give each level its share of ``spec`` (None: as rendered)."""
    if not spec:
        return None
    share = parse_mix(spec)
    count = {lv: levels.count(lv) for lv in set(levels)}
    log.info("batch level weights %s", share)
    return torch.tensor([share.get(lv, 0.0) / count[lv] for lv in levels], dtype=torch.float64)
