"""Reward throughput: images per second on this machine at 512 px (a benchmark; never timed assertions in tests).

    python scripts/bench_rewards.py [--threads 2] [--batch 8] [--repeats 3] [--only NAME ...]
    python scripts/bench_rewards.py --tiny
    python scripts/bench_rewards.py --device cuda --reward "{name: hpsv3, path: /weights/HPSv3}"

Every reward that runs on a CPU scores the same fixed-seed batch (smooth random colour fields, 512×512, with
the prompt's quoted text written on them, so the OCR engine has text to read) ``--repeats`` times after a
warm-up call on one image; the rate is the batch size over the median time. Model rewards are built at their
REAL size with random weights (``random_init: true`` on folders holding only the published ``config.json`` and
processor files, written here): throughput depends on the architecture, not on the weights. Rewards run one at
a time and are freed before the next. ``--tiny`` runs the same loop on the ``flowalign tiny-reward`` folders
(seconds: it checks the script end to end). ``--reward SPEC`` (repeatable; a name or the YAML mapping a
config's ``rewards:`` list holds) benchmarks those rewards as given instead, e.g. real downloads on a GPU
(``--frames N`` for video rewards). Prints one Markdown table row per reward, with the threads and the
1-minute load average.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys
import tempfile
import time
from datetime import date
from pathlib import Path
from typing import Any, Callable, NamedTuple

import torch

PROMPT = 'a photo of a red dog beside a sign that says "flow align"'
GENEVAL_META = {"tag": "colors", "include": [{"class": "dog", "count": 1, "color": "red"}]}
#: the Qwen2-VL rewards, measured on a GPU with the real downloads: the 7B ones (≈33 GB in fp32) do not fit a
#: 24 GB CPU machine, and VideoAlign scores videos (every frame's visual tokens through a 2B model)
GPU_ONLY = {
    "hpsv3": "Qwen2-VL-7B-Instruct + HPSv3 head",
    "unified_reward": "Qwen2.5-VL-7B (UnifiedReward-qwen-7b)",
    "videoalign": "Qwen2-VL-2B + LoRA (VideoReward), videos",
}


# The published configurations of the real models (the fields that set the architecture's size).
def _hf_clip_config(text: tuple[int, int, int, int], vision: tuple[int, int, int, int], projection: int,
                    act: str) -> dict[str, Any]:
    """``(hidden, intermediate, layers, heads)`` per tower of a transformers ``CLIPConfig`` at 224 px / patch 14."""
    def tower(dims: tuple[int, int, int, int]) -> dict[str, Any]:
        return dict(zip(("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"), dims),
                    hidden_act=act)
    return {"text_config": {**tower(text), "max_position_embeddings": 77},
            "vision_config": {**tower(vision), "image_size": 224, "patch_size": 14}, "projection_dim": projection}


PICKSCORE_CLIP = _hf_clip_config((1024, 4096, 24, 16), (1280, 5120, 32, 16), 1024, "gelu")  # yuvalkirstain/PickScore_v1
OPENAI_CLIP_L14 = _hf_clip_config((768, 3072, 12, 12), (1024, 4096, 24, 16), 768, "quick_gelu")  # openai/clip-vit-large-patch14


def write_hf_clip(folder: Path, config: dict[str, Any]) -> None:
    """``config.json``, a full CLIP tokenizer and the 224 px ``CLIPImageProcessor`` (no weights)."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPProcessor

    from pipelines.tiny_tokenizers import clip_tokenizer

    tok = clip_tokenizer(vocab_size=None, model_max_length=77)
    text = {**config["text_config"], "vocab_size": len(tok), "bos_token_id": tok.bos_token_id,
            "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}
    CLIPConfig(text_config=text, vision_config=config["vision_config"],
               projection_dim=config["projection_dim"]).save_pretrained(folder)
    processor = CLIPImageProcessor(size={"shortest_edge": 224}, crop_size={"height": 224, "width": 224})
    CLIPProcessor(image_processor=processor, tokenizer=tok).save_pretrained(folder)


def write_mask2former(folder: Path) -> None:
    """facebook/mask2former-swin-small-coco-instance: Swin-S backbone, 100 queries, 80 COCO classes."""
    from transformers import Mask2FormerConfig, Mask2FormerImageProcessor, SwinConfig

    from rewards.geneval.vocabulary import CLASSES

    backbone = SwinConfig(embed_dim=96, depths=[2, 2, 18, 2], num_heads=[3, 6, 12, 24], window_size=7,
                          out_features=["stage1", "stage2", "stage3", "stage4"])
    Mask2FormerConfig(backbone_config=backbone, num_queries=100, num_labels=len(CLASSES),
                      id2label=dict(enumerate(CLASSES)), label2id={c: i for i, c in enumerate(CLASSES)}
                      ).save_pretrained(folder)
    Mask2FormerImageProcessor(size={"shortest_edge": 384, "longest_edge": 1333}, size_divisor=32,
                              ignore_index=255).save_pretrained(folder)


def write_dinov2_base(folder: Path) -> None:
    """facebook/dinov2-base: ViT-B/14 and its 256 → 224 crop processor."""
    from transformers import BitImageProcessor, Dinov2Config

    Dinov2Config(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, patch_size=14,
                 image_size=518).save_pretrained(folder)
    BitImageProcessor(size={"shortest_edge": 256}, crop_size={"height": 224, "width": 224}, do_center_crop=True,
                      image_mean=[0.485, 0.456, 0.406], image_std=[0.229, 0.224, 0.225], resample=3,
                      do_convert_rgb=True).save_pretrained(folder)


def _folder(root: Path, name: str, write: Callable[[Path], None]) -> str:
    folder = root / name
    folder.mkdir()
    write(folder)
    return str(folder)


class Case(NamedTuple):
    name: str
    arch: str
    #: the reward's options at real size (random weights) in a scratch folder
    real: Callable[[Path], dict[str, Any]]


CASES = [
    Case("brightness", "pixel statistic", lambda root: {}),
    Case("saturation", "pixel statistic", lambda root: {}),
    Case("jpeg_compressibility", "PIL JPEG encode (quality 95)", lambda root: {}),
    Case("vvr", "rule-based verifier (colour segmentation)", lambda root: {}),
    Case("ocr", "rapidocr: PP-OCRv4 det + rec (ONNX, onnxruntime)", lambda root: {"engine": "rapidocr"}),
    Case("lpips", "AlexNet + LPIPS linear heads", lambda root: {"net": "alex", "random_init": True}),
    Case("image_similarity", "DINOv2 ViT-B/14, 224 px",
         lambda root: {"path": _folder(root, "dinov2", write_dinov2_base), "random_init": True}),
    Case("clip_score", "open_clip ViT-L/14 (quickgelu), 224 px", lambda root: {"random_init": True}),
    Case("aesthetic", "open_clip ViT-L/14 + LAION MLP head, 224 px", lambda root: {"random_init": True}),
    Case("pickscore", "transformers CLIP ViT-H/14, 224 px",
         lambda root: {"path": _folder(root, "pickscore", lambda f: write_hf_clip(f, PICKSCORE_CLIP)), "random_init": True}),
    Case("hps", "open_clip ViT-H/14, 224 px", lambda root: {"random_init": True}),
    Case("geneval", "Mask2Former Swin-S (COCO, 384 px) + CLIP ViT-L/14 colours",
         lambda root: {"path": _folder(root, "mask2former", write_mask2former),
                       "clip_path": _folder(root, "clip", lambda f: write_hf_clip(f, OPENAI_CLIP_L14)),
                       "random_init": True}),
]


def tiny_options(name: str, root: Path) -> dict[str, Any]:
    """The options loading ``name``'s ``flowalign tiny-reward`` folder (the builder's own when it returns them)."""
    from rewards.tiny_rewards import TINY_BUILDERS

    if name == "lpips":  # no tiny folder: its real backbone is small; random weights, nothing fetched
        return {"random_init": True}
    if name == "ocr":  # the CPU engine its row measures (its tiny folder is GOT-OCR 2.0's, a GPU engine)
        return {"engine": "rapidocr"}
    if name not in TINY_BUILDERS:
        return {}
    folder = root / name
    folder.mkdir()
    built = TINY_BUILDERS[name](folder)
    return {k: str(v) for k, v in built.items()} if isinstance(built, dict) else {"path": str(folder)}


def make_batch(n: int, size: int, seed: int = 0) -> torch.Tensor:
    """``(n, 3, size, size)`` in [0, 1]: smooth random colour fields with the prompt's quoted text on each."""
    import numpy as np
    from PIL import Image, ImageDraw, ImageFont

    g = torch.Generator().manual_seed(seed)
    fields = torch.nn.functional.interpolate(torch.rand(n, 3, 6, 6, generator=g), size=(size, size),
                                             mode="bicubic", align_corners=False).clamp(0, 1)
    font = ImageFont.load_default(size=max(8, size // 10))
    images = []
    for field in fields:
        picture = Image.fromarray((field.permute(1, 2, 0).numpy() * 255).round().astype(np.uint8))
        ImageDraw.Draw(picture).text((size // 10, size // 2), PROMPT.split('"')[1], fill=(0, 0, 0), font=font)
        images.append(torch.from_numpy(np.array(picture)).permute(2, 0, 1).float() / 255)
    return torch.stack(images)


def metadata(n: int, samples: torch.Tensor) -> list[dict[str, Any]]:
    """Each sample's metadata, holding what every benchmarked reward reads (GenEval's line, a VVR task, the
    reference images of lpips and image_similarity: the sample's neighbour)."""
    from rewards.vvr.generate import generate_tasks
    from rewards.vvr.tasks import task_dict

    tasks = generate_tasks(n, seed=0, level="medium")
    return [{**GENEVAL_META, "task": task_dict(tasks[i]), "reference": samples[(i + 1) % n],
             "image": samples[(i + 1) % n]} for i in range(n)]


def measure(reward: Any, samples: torch.Tensor, prompts: list[str], meta: list[dict[str, Any]],
            repeats: int) -> tuple[float, list[float]]:
    """Warm-up, then ``repeats`` timed calls: ``(images per second over the median, the times)``. Raises when a
    score is not finite (a broken reward must not get a rate)."""
    def call(n: int) -> None:
        out = reward(samples[:n], prompts[:n], meta[:n])
        for name, value in out.components.items():
            if not torch.isfinite(value).all():
                raise RuntimeError(f"{name}: non-finite scores")
        if samples.is_cuda:
            torch.cuda.synchronize()

    call(1)  # warm-up on one image: lazy imports, caches such as GenEval's colour heads
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call(len(prompts))
        times.append(time.perf_counter() - start)
    return samples.shape[0] / statistics.median(times), times


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Benchmark the selected rewards one at a time; one result row each (also printed as a table row)."""
    import rewards
    from flowalign.config import reward_spec_from_text

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    samples = make_batch(args.batch, args.size).to(device)
    prompts = [PROMPT] * args.batch
    meta = metadata(args.batch, samples)
    if args.frames:  # videos (B, F, 3, H, W): each image panning sideways, 8 px a frame
        samples = torch.stack([samples.roll(8 * f, dims=-1) for f in range(args.frames)], 1)
    unit = "videos/s" if args.frames else "images/s"
    if args.reward:
        specs = [reward_spec_from_text(text, "--reward") for text in args.reward]
        todo = [(s.name, s.name, lambda root, o=s.options: dict(o), f"--reward {text!r}")
                for s, text in zip(specs, args.reward)]
    else:
        cases = [c for c in CASES if not args.only or c.name in args.only]
        todo = [(c.name, "tiny-reward folder" if args.tiny else c.arch,
                 (lambda root, n=c.name: tiny_options(n, root)) if args.tiny else c.real,
                 ("--tiny " if args.tiny else "") + f"--only {c.name}") for c in cases]
    print(f"# {date.today()}  threads {args.threads}  batch {args.batch} at {args.size} px  frames {args.frames}"
          f"  repeats {args.repeats}  device {device}  torch {torch.__version__}", flush=True)
    print(f"| reward | architecture | {unit} | batch | threads | load average (1 min) | command |")
    print("|---|---|---|---|---|---|---|", flush=True)
    rows = []
    for name, arch, options_of, command in todo:
        with tempfile.TemporaryDirectory() as tmp:
            reward = rewards.load(name, **options_of(Path(tmp)))
            rate, times = measure(reward, samples, prompts, meta, args.repeats)
        del reward
        gc.collect()  # one model in memory at a time
        load = os.getloadavg()[0]
        rows.append({"reward": name, "architecture": arch, "images_per_s": rate, "times_s": times,
                     "batch": args.batch, "threads": args.threads, "load_average": load})
        print(f"| `{name}` | {arch} | {rate:.3g} | {args.batch} | {args.threads} | {load:.1f} | `scripts/bench_rewards.py {command}` |",
              flush=True)
    for name in ([] if args.reward or args.tiny else [n for n in GPU_ONLY if not args.only or n in args.only]):
        video = " --frames 16" if name == "videoalign" else ""
        print(f"| `{name}` | {GPU_ONLY[name]} | GPU only | | | | `scripts/bench_rewards.py --device cuda{video} "
              f"--reward \"{{name: {name}, path: DIR}}\"` |")
    if args.json:
        from flowalign.io import atomic_path

        with atomic_path(args.json) as tmp:
            tmp.write_text(json.dumps(rows, indent=1))
    return rows


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="the tiny-reward folders instead of real-size models")
    p.add_argument("--only", nargs="+", default=None, metavar="NAME", help="these rewards of the CPU set only")
    p.add_argument("--reward", action="append", default=[], metavar="SPEC", help="benchmark this reward as given")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--size", type=int, default=512)
    p.add_argument("--frames", type=int, default=0, help="score videos of this many frames (rate in videos/s)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", default=None, help="also write the rows to this JSON file")
    args = p.parse_args(argv)
    known = {c.name for c in CASES} | set(GPU_ONLY)
    if args.only and set(args.only) - known:
        p.error(f"--only: unknown reward(s) {sorted(set(args.only) - known)}; choose from {sorted(known)}")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; 0 when every reward got a finite rate."""
    rows = run(parse(argv))
    return 0 if all(math.isfinite(r["images_per_s"]) for r in rows) else 1


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.exit(main())
