"""A whole tiny-world run: data → VAE → latents → (decoder) → transformer → export → samples → evaluation.

Every stage is resumable (``--resume`` continues from the newest complete checkpoint of the stage it was
in; a finished stage is never redone unless it is given a larger budget); the work folder ``--out``
holds the data and latent caches, one folder per stage and ``train.log``.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch

from flowalign.io import write_json
from pipelines.pretrain import export as export_
from pipelines.pretrain import wan
from pipelines.pretrain.autoencoder import encode_latents, finetune_decoder, train_vae
from pipelines.pretrain.data import cached, parse_mix, render_benchmark, synthetic_scenes, vocabulary
from pipelines.pretrain.dit import flow_matching_loss, train_dit
from pipelines.pretrain.families import FAMILIES
from pipelines.pretrain.work_folder import claim_work_folder, redo_after_vae

log = logging.getLogger("flowalign.pretrain")


def setup(args: argparse.Namespace, out: Path) -> None:
    """Threads, seeds and the log (``OUT/train.log`` and stderr)."""
    torch.set_num_threads(args.threads)
    claim_work_folder(out)  # checked by the command's argument check
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

    dlog.set_verbosity_error()  # no per-step CLIP truncation warnings for the few over-long prompts
    tlog.set_verbosity_error()
    log.info("args: %s", vars(args))
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)


def load_data(family, args: argparse.Namespace, out: Path) -> dict:
    if hasattr(family, "load_data"):  # a family whose items are not one rendered task each (edit pairs)
        return family.load_data(args, out)
    if getattr(args, "synthetic", False):
        return cached(out, lambda: synthetic_scenes(args.n_scenes, args.seed, args.size))
    return cached(out, lambda: render_benchmark(family.BENCH, args.n_scenes, parse_mix(args.mix), args.seed, args.size))


def train(family, data: dict, args: argparse.Namespace, out: Path):
    """Every training stage in order → ``(pipe, ema, max_sequence_length)``."""
    if hasattr(family, "train"):  # a family with stages of its own (the unified model's reflection writer)
        return family.train(data, args, out)
    pretrained = getattr(args, "init_from", None)
    if pretrained:
        pipe, max_seq = family.load_pretrained(Path(pretrained), args, data["prompts"])
    else:
        words = vocabulary(data["prompts"])
        log.info("%d prompt words", len(words))
        pipe, max_seq = family.build(words, data["prompts"], args)
    pipe.set_progress_bar_config(disable=True)
    for name in family.COMPONENTS:
        log.info("  %-15s %8.3fM params", name, sum(p.numel() for p in getattr(pipe, name).parameters()) / 1e6)
    recipe = family.recipe(pipe.vae, args)
    if not pretrained:  # a pretrained VAE stays as it is, with its own latent factors
        train_vae(pipe.vae, data["pixels"], args, out, recipe, on_continue=lambda: redo_after_vae(out))
    pipe.vae.requires_grad_(False)
    x0 = encode_latents(pipe.vae, data["pixels"], out,
                        lambda z: family.set_latent_factors(pipe.vae, z, keep=bool(pretrained)))
    if not family.DECODER_AFTER_DIT:
        finetune_decoder(pipe.vae, data["pixels"], x0, args, out, recipe)
    per_item = getattr(family, "IMAGES_PER_ITEM", 1)  # an editing item: its images' latents side by side
    items = x0.unflatten(0, (-1, per_item)) if per_item > 1 else x0
    ema = train_dit(pipe, data, items, args, out, family.TRAINED, family.conditioning(pipe, args, max_seq),
                    getattr(family, "flow_loss", flow_matching_loss))
    if family.DECODER_AFTER_DIT:
        finetune_decoder(pipe.vae, data["pixels"], x0, args, out, recipe)
    return pipe, ema, max_seq


def evaluate(family, folder: Path, n: int, out: Path) -> dict:
    """Held-out accuracy per level (and, for videos, what the VAE alone lets through) → ``OUT/eval.json``."""
    if hasattr(family, "evaluate"):  # a family whose model is not evaluated as a text-to-image policy
        results = family.evaluate(folder, n, out)
        write_json(out / "eval.json", results)
        return results
    results = export_.evaluate_levels(folder, family.BENCH, family.EVAL_LEVELS, n, out)
    if family is wan:
        import pipelines

        vae = pipelines.load(folder).pipe.vae
        for level in family.EVAL_LEVELS:
            results[level]["vae_ceiling"] = export_.vae_ceiling(vae, family.BENCH, level, min(n, 48),
                                                                results["settings"]["height"])
            log.info("vae ceiling %s: %s", level, results[level]["vae_ceiling"])
    write_json(out / "eval.json", results)
    return results


def sample_training_prompts(folder: Path, data: dict, args: argparse.Namespace, out: Path) -> None:
    """``OUT/samples_train_prompts.png``: the exported model's samples of ``--demo-n`` training prompts."""
    rng = random.Random(12345)
    demo = [data["prompts"][i] for i in rng.sample(range(len(data["prompts"])), args.demo_n)]
    export_.sample_prompts(folder, demo, out / "samples_train_prompts.png")


def run(args: argparse.Namespace) -> None:
    """``flowalign pretrain-tiny FAMILY ...`` (see :mod:`pipelines.pretrain.cli` for the options)."""
    family = FAMILIES[args.family]
    out, folder = Path(args.out), Path(args.export)
    setup(args, out)
    if args.dec_minutes is None:  # the SD3 decoder stage: 5 minutes from scratch, none from a pretrained model
        args.dec_minutes = 0.0 if getattr(args, "init_from", None) else 5.0
    t_start = time.time()
    if args.eval_only:
        print(json.dumps(evaluate(family, folder, args.eval_n or 200, out), indent=2))
        return
    data = load_data(family, args, out)
    pipe, ema, max_seq = train(family, data, args, out)
    export_.export(pipe, ema, family.PIPELINE, family.sampling_defaults(args, max_seq), folder,
                    overwrite=args.overwrite)
    if args.demo_n:
        getattr(family, "demo", sample_training_prompts)(folder, data, args, out)
    log.info("total wall time %.1f min", (time.time() - t_start) / 60)
    if args.eval_n:
        evaluate(family, folder, args.eval_n, out)

