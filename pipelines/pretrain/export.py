"""The end of a tiny-world run: the diffusers folder, sample sheets and the held-out evaluation.

The export writes the EMA weights as a diffusers folder (``from_pretrained`` opens it offline) with
``flowalign.json`` sampling defaults, keeping a hand-written model card and sample sheets already there.
The evaluation is ``flowalign evaluate``'s own code path (:func:`pipelines.load` +
:func:`flowalign.evaluation.evaluate`) on the benchmark's held-out splits.
"""

from __future__ import annotations

import logging
import math
import shutil
import time
from pathlib import Path

import numpy as np
import torch

from flowalign.ema import EMA
from flowalign.io import atomic_dir, atomic_path, check_out_dir

log = logging.getLogger("flowalign.pretrain")

#: hand-written files of an exported folder that a new export keeps
KEPT = ("README.md", "samples.png", "samples.gif")


#: the writer name of an exported folder's marker (a folder an export wrote is replaced without --overwrite)
WRITER = "pretrain-export"


def check_export_folder(folder: Path, overwrite: bool) -> None:
    """Refuse (before hours of training) an ``--export`` folder with files no export wrote, e.g. a shipped
    asset or another model, unless ``--overwrite``."""
    check_out_dir(folder, writer=WRITER, overwrite=overwrite, flag="--export")


def export(pipe, ema: EMA, pipeline_class: str, defaults: dict, folder: Path, overwrite: bool = False) -> None:
    """Save ``pipe`` with the EMA weights swapped in to ``folder`` (its files swapped in by renames) and reload it."""
    import diffusers

    from pipelines.tiny import write_sampling_defaults

    # only the export's own files are replaced; other files (a model card) stay
    with atomic_dir(folder, writer=WRITER, overwrite=overwrite, flag="--export") as tmp:
        with ema.swapped_in():
            pipe.save_pretrained(tmp, safe_serialization=True)
        write_sampling_defaults(tmp, **defaults)
        for keep in KEPT:
            if (folder / keep).is_file():
                shutil.copy2(folder / keep, tmp / keep)
    getattr(diffusers, pipeline_class).from_pretrained(folder)  # the folder must reload as-is
    size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
    log.info("export: %s (%.1f MB)", folder, size / 2**20)


def save_sheet(samples: torch.Tensor, png: Path, cols: int = 8) -> None:
    """Images ``(N, 3, H, W)`` in [0, 1] → a PNG grid ``cols`` wide; clips ``(N, F, 3, H, W)`` → a PNG with
    one row per clip and one column per frame, and a GIF of the clips tiled 4 wide, playing together."""
    from PIL import Image

    v = (samples.clamp(0, 1) * 255).round().to(torch.uint8).movedim(-3, -1).numpy()  # (..., H, W, 3)
    if v.ndim == 4:
        rows = math.ceil(len(v) / cols)
        pad = np.full((rows * cols - len(v), *v.shape[1:]), 255, np.uint8)
        tiles = np.concatenate([v, pad]).reshape(rows, cols, *v.shape[1:])
        with atomic_path(png) as tmp:
            Image.fromarray(np.concatenate([np.concatenate(list(row), axis=1) for row in tiles], axis=0)).save(tmp, format="PNG")
        return
    with atomic_path(png) as tmp:
        Image.fromarray(np.concatenate([np.concatenate(list(clip), axis=1) for clip in v], axis=0)).save(tmp, format="PNG")
    n, f, h, w, _ = v.shape
    rows = math.ceil(n / 4)
    pad = np.full((rows * 4 - n, f, h, w, 3), 255, np.uint8)
    frames = np.concatenate([v, pad]).reshape(rows, 4, f, h, w, 3).transpose(2, 0, 3, 1, 4, 5)
    frames = frames.reshape(f, rows * h, 4 * w, 3).repeat(2, axis=1).repeat(2, axis=2)  # 2x: a 32 px clip is visible
    with atomic_path(png.with_suffix(".gif")) as tmp:
        Image.fromarray(frames[0]).save(tmp, format="GIF", save_all=True,
                                        append_images=[Image.fromarray(x) for x in frames[1:]], duration=125, loop=0)


def sample_prompts(folder: Path, prompts: list[str], png: Path) -> None:
    """The exported model's samples of ``prompts`` (noise of seed 0 + i) as a sheet, prompts beside it."""
    import pipelines
    from flowalign.evaluation import sample_seeded

    save_sheet(sample_seeded(pipelines.load(folder), prompts, seed=0, progress=False), png)
    with atomic_path(png.with_suffix(".txt")) as tmp:
        tmp.write_text("\n".join(prompts) + "\n")


def evaluate_levels(folder: Path, bench: str, levels: tuple[str, ...], n: int, out: Path) -> dict:
    """``flowalign evaluate --bench BENCH --level L --n n`` for each level, into ``OUT/eval-<level>/``."""
    import pipelines
    from flowalign.benchmarks import load_benchmark
    from flowalign.evaluation import evaluate

    policy = pipelines.load(folder)
    results: dict = {}
    for level in levels:
        split = load_benchmark(bench, level, n, split="validation")
        t0 = time.time()
        m = evaluate(policy, split.prompts, split.metadata, split.reward, seed=0, batch_size=16,
                     out_dir=out / f"eval-{level}", progress=False)
        results[level] = {"n": m["n"], "accuracy": m.get("accuracy"), "mean_score": m["mean_score"],
                          "per_constraint": m.get("per_constraint"), "seconds": round(time.time() - t0, 1)}
        log.info("eval %s: %s", level, results[level])
    results["settings"] = dict(policy.defaults)
    return results


@torch.no_grad()
def vae_ceiling(vae, bench: str, level: str, n: int, size: int) -> dict:
    """What a perfect transformer could reach through this VAE: the first ``n`` held-out tasks of ``level``
    rendered, encoded (posterior mean), decoded and scored by the benchmark's verifier. ``shapes``: passes
    per named shape of each task's first constraint."""
    from flowalign.benchmarks import load_benchmark, render_task

    split = load_benchmark(bench, level, n, split="validation")
    decoded = []
    for meta in split.metadata:
        x = render_task(bench, meta, size).movedim(-3, 0)[None] * 2 - 1  # (1, 3, F, H, W) in [-1, 1]
        rec = vae.decode(vae.encode(x).latent_dist.mean).sample[0]
        decoded.append(((rec.clamp(-1, 1) + 1) / 2).movedim(0, -3))  # (F, 3, H, W) in [0, 1]
    verdicts = split.reward(torch.stack(decoded), split.prompts, split.metadata).info
    shapes: dict[str, tuple[int, int]] = {}
    for meta, verdict in zip(split.metadata, verdicts):
        shape = meta["task"]["constraints"][0].get("ref", {}).get("shape", "?")
        good, total = shapes.get(shape, (0, 0))
        shapes[shape] = (good + bool(verdict["all_passed"]), total + 1)
    passed = sum(bool(v["all_passed"]) for v in verdicts)
    return {"n": len(verdicts), "accuracy": passed / max(1, len(verdicts)),
            "shapes": {k: f"{g}/{t}" for k, (g, t) in sorted(shapes.items())}}
