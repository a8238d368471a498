"""The tiny FLUX.1-Kontext-format super-resolution model: the editing model fine-tuned on ``sr`` pairs.

Data: ``sr`` training tasks (scene seeds < 1000, no scene of the validation or test splits), each an
*item* of two images: the LR image (the degraded scene, ``HR_SIZE / scale`` px) resized to ``--size``
exactly as :class:`pipelines.kontext.KontextPolicy` resizes its input image, and the HR scene rendered at
``--size``. The pixel cache interleaves them: ``pixels[2i]`` LR (upsampled), ``pixels[2i + 1]`` HR.

Model: every component of a tiny FLUX.1 Kontext folder (``--init-from``, default the shipped editing model
``assets/tiny-kontext-vvr-edit``), its T5 vocabulary extended with the instruction's words
(:func:`pipelines.pretrain.kontext.extend_t5`). Only the transformer trains: the instruction is one fixed
sentence, so its text embedding is a constant the transformer learns to read. Starting from a model that
already copies its context image into its output, a few CPU minutes of flow matching turn the copy into an
upscale: this is the *cold start* of OARS (``docs/methods/oars.md``), the weights RL stages begin from.

Training: the editing family's rectified flow on the HR latents with the LR latents as context tokens
(:func:`pipelines.pretrain.kontext.flow_loss`), no empty-prompt dropout, no CFG (``guidance_scale`` 1.0).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
from pathlib import Path

from flowalign.errors import UserError
from pipelines.pretrain import kontext

log = logging.getLogger("flowalign.pretrain")

HELP = "the FLUX.1-Kontext-format super-resolution model on sr (LR, HR) pairs (assets/tiny-kontext-sr)"
NAME, BENCH, PIPELINE = "kontext", "sr", "FluxKontextPipeline"
TRAINED = ("transformer",)
COMPONENTS = kontext.COMPONENTS
EVAL_LEVELS = ("easy", "medium", "hard")
DECODER_AFTER_DIT = False
IMAGES_PER_ITEM = 2
DEFAULTS = dict(out="runs/pretrain-kontext-sr", export="assets/tiny-kontext-sr", size=64, threads=1,
                n_scenes=3000, mix="easy:0.34,medium:0.33,hard:0.33", vae_minutes=0.0, vae_batch=32, vae_lr=2e-3,
                dit_minutes=10.0, batch=8, cfg=1.0, demo_n=8, max_sequence_length=0, drop=0.0)
set_latent_factors, conditioning, flow_loss = kontext.set_latent_factors, kontext.conditioning, kontext.flow_loss


def recipe(vae, args: argparse.Namespace):
    """The editing family's autoencoder recipe (no VAE or decoder stage runs: every component is pretrained)."""
    return kontext.recipe(vae, argparse.Namespace(**{"dec_batch": 16, **vars(args)}))


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options only this family has."""
    p.add_argument("--init-from", default="assets/tiny-kontext-vvr-edit",
                   help="the tiny FLUX.1 Kontext folder every component starts from")


def check(args: argparse.Namespace) -> None:
    """Bad values as one-line errors, before anything is rendered."""
    index = Path(args.init_from or "") / "model_index.json"
    if not index.is_file() or json.loads(index.read_text()).get("_class_name") != PIPELINE:
        raise UserError(f"--init-from {args.init_from!r}: give a tiny FLUX.1 Kontext folder (e.g. "
                        "assets/tiny-kontext-vvr-edit) to start the super-resolution model from")
    if args.cfg != 1.0:
        raise UserError(f"--cfg {args.cfg}: the tiny Kontext model has no guidance input; leave --cfg at 1.0")


def load_data(args: argparse.Namespace, out: Path) -> dict:
    """The rendered pairs (cached in ``OUT``): ``pixels (2N, 3, size, size)`` uint8, ``prompts``, ``levels``."""
    from pipelines.pretrain.data import cached, parse_mix

    return cached(out, lambda: render_pairs(args.n_scenes, parse_mix(args.mix), args.seed, args.size))


def render_pairs(n: int, mix: dict[str, float], seed: int, size: int) -> dict:
    """``n`` training ``sr`` tasks over the levels of ``mix`` (level ``i`` with task seed ``10·seed + i``): the
    LR image resized to ``size`` as the policy resizes its input, and the HR scene at ``size``."""
    import torch  # here, not at the top: pretrain-tiny's parser (every --help) reads this module

    from flowalign.sampling.inputs import load_input_image
    from pipelines._common import resize_input
    from pipelines.pretrain.data import level_counts, task_seed
    from rewards.sr import generate_sr_tasks, render_hr, render_lr

    pixels, prompts, levels = [], [], []
    for i, (level, k) in enumerate(level_counts(n, mix)):
        if k == 0:
            continue
        for task in generate_sr_tasks(k, seed=task_seed(seed, i), level=level):
            lr = resize_input(load_input_image(render_lr(task)), size, size)
            for image in (lr, load_input_image(render_hr(task, size))):
                pixels.append((image * 255).round().to(torch.uint8))
            prompts.append(task.prompt)
            levels.append(level)
    return {"pixels": torch.stack(pixels).contiguous(), "prompts": prompts, "levels": levels}


def load_pretrained(folder: Path, args: argparse.Namespace, prompts: list[str]):
    """``folder``'s ``FluxKontextPipeline``, T5's vocabulary extended to ``prompts``' words →
    ``(pipe, max_sequence_length)``."""
    from diffusers import FluxKontextPipeline

    from pipelines.pretrain.data import longest_prompt, vocabulary

    pipe = FluxKontextPipeline.from_pretrained(folder)
    pipe.tokenizer_2 = kontext.extend_t5(pipe.tokenizer_2, pipe.text_encoder_2, vocabulary(prompts))
    longest = longest_prompt(pipe.tokenizer_2, sorted(set(prompts)))
    max_seq = args.max_sequence_length or int(math.ceil((longest + 2) / 8) * 8)
    pipe.tokenizer_2.model_max_length = max_seq
    log.info("max_sequence_length %d (longest instruction %d tokens)", max_seq, longest)
    return pipe, max_seq


def sampling_defaults(args: argparse.Namespace, max_seq: int) -> dict:
    """``flowalign.json``: the Kontext family's, one conditional pass per step."""
    return kontext.sampling_defaults(args, max_seq)


def demo(folder: Path, data: dict, args: argparse.Namespace, out: Path) -> None:
    """``OUT/samples_train_pairs.png``: LR (upsampled) | the exported model's SR | HR, two items a row."""
    kontext.demo(folder, data, args, out)
