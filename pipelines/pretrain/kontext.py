"""The tiny FLUX.1-Kontext-format editing world: what differs from the SD3 and Wan families.

Data: ``vvr_edit`` training tasks (held-out compositions excluded, task seeds < 1000), each an *item* of two
images, the source scene and the correctly edited one, both rendered at the benchmark's input size and
resized to ``--size`` exactly as :class:`pipelines.kontext.KontextPolicy` resizes its input image (so the
context the model trains on is the context it is evaluated with). The pixel cache interleaves them:
``pixels[2i]`` source, ``pixels[2i + 1]`` target of item ``i``.

Components: taken from the shipped tiny SD3 model (``--init-from``, default ``assets/tiny-sd3-vvr``):

- its f4 VAE, frozen, with its latent factors (FLUX normalises as SD3 does: ``(z − shift)·scale``);
- its CLIP-L stand-in, loaded as ``CLIPTextModel`` (FLUX reads CLIP's pooled output only), and tokenizer;
- its T5 stand-in (``T5EncoderModel``, d_model 128) and word-level tokenizer, *extended* with the
  instruction words it lacks ("make", "move", "remove", "add"): whole-word pieces appended after the old
  vocabulary (old ids unchanged) and as many new embedding rows, drawn around the old rows' mean with
  their spread (:func:`extend_t5`). Without them the verbs would be spelt in untrained character pieces.

A fresh ``FluxTransformer2DModel``: patch 1 on 2×2-packed latents (16 channels), 4 double-stream +
6 single-stream blocks, 4 heads × 32 (RoPE axes 4 + 14 + 14, FLUX.1's proportions), no guidance embedding
(:data:`TRANSFORMER`). Kontext-dev is guidance-*distilled* from a CFG teacher; a model trained from scratch
has no teacher, so the embedding would have nothing to learn. This model is a plain conditional flow and
samples with one pass per step (``guidance_scale`` 1.0 in ``flowalign.json``; ``KontextPolicy`` passes no
guidance to a transformer without the embedding) and is trained without empty-prompt dropout.

Training (:func:`flow_loss`): rectified flow on the *target* latents with the *source* latents as context
tokens, fed exactly as ``KontextPolicy.velocity`` and ``FluxKontextPipeline`` feed them (target tokens then
context tokens in one sequence, context position ids with first axis 1, the context's output dropped;
``timestep = σ``, the transformer multiplies by 1000). Text goes through the pipeline's own
``encode_prompt``. Both text encoders train jointly with the transformer: an instruction's grammar is new
to them ("make the red circle blue": the last colour names the *new* colour) and the new T5 rows must
learn their words; together they are 1.4 M parameters, a small cost next to the transformer's.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import random
from pathlib import Path
from typing import TYPE_CHECKING

from flowalign.cli.common import add_number
from flowalign.limits import MAX_BATCH, MAX_LAYERS
from flowalign.errors import UserError
from flowalign.io import atomic_path

# torch and diffusers are imported by the functions that train: pretrain-tiny's parser (every --help) reads
# this module
if TYPE_CHECKING:
    import torch

log = logging.getLogger("flowalign.pretrain")

HELP = "the FLUX.1-Kontext-format editing model on rendered vvr_edit pairs (assets/tiny-kontext-vvr-edit)"
NAME, BENCH, PIPELINE = "kontext", "vvr_edit", "FluxKontextPipeline"
TRAINED = ("transformer", "text_encoder", "text_encoder_2")
COMPONENTS = ("transformer", "vae", "text_encoder", "text_encoder_2")
EVAL_LEVELS = ("easy", "medium")
DECODER_AFTER_DIT = False
#: an item is a (source, target) pair of images
IMAGES_PER_ITEM = 2
DEFAULTS = dict(out="runs/pretrain-kontext", export="assets/tiny-kontext-vvr-edit", size=64, threads=1,
                n_scenes=16000, mix="easy:0.75,medium:0.25", vae_minutes=0.0, vae_batch=32, vae_lr=2e-3,
                dit_minutes=35.0, batch=32, cfg=1.0, demo_n=8, max_sequence_length=0, drop=0.0)
#: the transformer besides the sizes read from the text encoders and the VAE
TRANSFORMER = dict(patch_size=1, num_layers=4, num_single_layers=6, attention_head_dim=32, num_attention_heads=4,
                   guidance_embeds=False, axes_dims_rope=(4, 14, 14))


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options only the Kontext family has."""
    p.add_argument("--init-from", default="assets/tiny-sd3-vvr",
                   help="the tiny SD3 folder whose VAE, CLIP-L and T5 stand-ins (and tokenizers) are reused")
    add_number(p, "--num-layers", type=int, lo=1, hi=MAX_LAYERS, default=TRANSFORMER["num_layers"], help="double-stream blocks")
    add_number(p, "--num-single-layers", type=int, lo=0, hi=MAX_LAYERS, default=TRANSFORMER["num_single_layers"],
                   help="single-stream blocks")
    add_number(p, "--dec-batch", type=int, lo=1, hi=MAX_BATCH, default=16)


def check(args: argparse.Namespace) -> None:
    """Bad values as one-line errors, before anything is rendered."""
    folder = Path(args.init_from or "")
    index = folder / "model_index.json"
    if not args.init_from or not index.is_file() or \
            json.loads(index.read_text()).get("_class_name") != "StableDiffusion3Pipeline":
        raise UserError(f"--init-from {args.init_from!r}: give a tiny SD3 folder (e.g. assets/tiny-sd3-vvr) whose "
                        "VAE and text encoders the Kontext model reuses")
    if args.cfg != 1.0:
        raise UserError(f"--cfg {args.cfg}: the tiny Kontext model has no guidance input and samples without CFG; "
                        "leave --cfg at 1.0")


# ------------------------------------------------------------------ data


def load_data(args: argparse.Namespace, out: Path) -> dict:
    """The rendered pairs (cached in ``OUT``): ``pixels (2N, 3, size, size)`` uint8, ``prompts``, ``levels``."""
    from pipelines.pretrain.data import cached, parse_mix

    return cached(out, lambda: render_pairs(args.n_scenes, parse_mix(args.mix), args.seed, args.size))


def render_pairs(n: int, mix: dict[str, float], seed: int, size: int) -> dict:
    """``n`` training edit tasks over the levels of ``mix`` (level ``i`` with task seed ``10·seed + i``), each
    rendered as source and edited scene at the benchmark's input size, resized to ``size`` as the policy does."""
    import torch
    from tqdm import tqdm

    from flowalign.sampling.inputs import load_input_image
    from pipelines._common import resize_input
    from pipelines.pretrain.data import level_counts, task_seed
    # an edit pair needs both renders of a task; the benchmark registry's renderers give one image per task
    from rewards.benchmarks import EDIT_IMAGE_SIZE
    from rewards.vvr_edit import generate_edit_tasks, render_result, render_source

    pixels, prompts, levels = [], [], []
    for i, (level, k) in enumerate(level_counts(n, mix)):
        if k == 0:
            continue
        for task in tqdm(generate_edit_tasks(k, seed=task_seed(seed, i), level=level, heldout="exclude"),
                         desc=f"render {level}", mininterval=5):
            for render in (render_source, render_result):
                image = resize_input(load_input_image(render(task, size=EDIT_IMAGE_SIZE)), size, size)
                pixels.append((image * 255).round().to(torch.uint8))
            prompts.append(task.prompt)
            levels.append(level)
    return {"pixels": torch.stack(pixels).contiguous(), "prompts": prompts, "levels": levels}


# ------------------------------------------------------------------ model


def load_pretrained(folder: Path, args: argparse.Namespace, prompts: list[str]):
    """A ``FluxKontextPipeline`` of ``folder``'s (a tiny SD3 model's) VAE and text encoders and a fresh
    transformer; T5's vocabulary extended to ``prompts``' words → ``(pipe, max_sequence_length)``."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxKontextPipeline, FluxTransformer2DModel
    from transformers import CLIPTextModel, CLIPTokenizer, T5EncoderModel, T5Tokenizer

    from pipelines.pretrain.data import longest_prompt, vocabulary
    from pipelines.tiny_twins.base import seeded
    from pipelines.tiny_twins.flux1 import FLUX_DEFAULTS

    vae = AutoencoderKL.from_pretrained(folder / "vae")
    clip = CLIPTextModel.from_pretrained(folder / "text_encoder")  # its projection head is not used by FLUX
    t5 = T5EncoderModel.from_pretrained(folder / "text_encoder_3")
    t5_tok = extend_t5(T5Tokenizer.from_pretrained(folder / "tokenizer_3"), t5, vocabulary(prompts))
    longest = longest_prompt(t5_tok, sorted(set(prompts)))
    max_seq = args.max_sequence_length or int(math.ceil((longest + 2) / 8) * 8)
    t5_tok.model_max_length = max_seq
    log.info("max_sequence_length %d (longest instruction %d tokens)", max_seq, longest)
    config = {**TRANSFORMER, "num_layers": args.num_layers, "num_single_layers": args.num_single_layers,
              "in_channels": 4 * vae.config.latent_channels, "joint_attention_dim": t5.config.d_model,
              "pooled_projection_dim": clip.config.hidden_size}
    with seeded(args.seed):
        transformer = FluxTransformer2DModel(**config)
    pipe = FluxKontextPipeline(scheduler=FlowMatchEulerDiscreteScheduler(**FLUX_DEFAULTS["scheduler"]), vae=vae,
                               text_encoder=clip, tokenizer=CLIPTokenizer.from_pretrained(folder / "tokenizer"),
                               text_encoder_2=t5, tokenizer_2=t5_tok, transformer=transformer)
    return pipe, max_seq


def extend_t5(tokenizer, t5, words: list[str]):
    """``tokenizer`` with a whole-word piece (lower-case and capitalised, as the tiny T5 vocabularies are) for
    each of ``words`` it lacks, appended so old ids stay; ``t5`` gets as many embedding rows, drawn from a
    fixed generator around the old rows' mean with their per-dimension spread."""
    import torch
    from transformers import T5Tokenizer

    vocab = [(piece, score) for piece, score in json.loads(tokenizer.backend_tokenizer.to_str())["model"]["vocab"]]
    known = {piece for piece, _ in vocab}
    new = list(dict.fromkeys(f"▁{v}" for w in words for v in (w, w.capitalize()) if f"▁{v}" not in known))
    if not new:
        return tokenizer
    log.info("T5 vocabulary: %d words added (%s)", len(new), " ".join(p[1:] for p in new[:12]))
    extended = T5Tokenizer(vocab=vocab + [(piece, -5.0) for piece in new], extra_ids=0,
                           model_max_length=tokenizer.model_max_length)
    old = t5.get_input_embeddings().weight.detach().clone()
    rows = max(len(old), len(vocab) + len(new))
    t5.resize_token_embeddings(rows, mean_resizing=False)
    g = torch.Generator().manual_seed(0)
    fresh = old.mean(0) + old.std(0) * torch.randn(rows - len(old), old.shape[1], generator=g)
    with torch.no_grad():
        t5.get_input_embeddings().weight[len(old) :] = fresh
    return extended


def recipe(vae, args: argparse.Namespace):
    """The SD3 family's autoencoder recipe (only its decoder stage runs: the VAE comes pretrained)."""
    from pipelines.pretrain import sd3

    return sd3.recipe(vae, argparse.Namespace(**{**vars(args), "vae_crop": 0}))


def set_latent_factors(vae, z: torch.Tensor, keep: bool = True) -> torch.Tensor:
    """``(z − shift)·scale`` with the pretrained VAE's own factors."""
    from pipelines.pretrain import sd3

    return sd3.set_latent_factors(vae, z, keep=True)


# ------------------------------------------------------------------ training


def conditioning(pipe, args: argparse.Namespace, max_seq: int):
    """``prompts → transformer kwargs``: T5 tokens and the pooled CLIP vector from ``encode_prompt``
    (with gradients)."""
    import torch

    def encode(prompts: list[str]) -> dict[str, torch.Tensor]:
        embeds, pooled, _ = pipe.encode_prompt(prompt=prompts, prompt_2=None, device=torch.device("cpu"),
                                               max_sequence_length=max_seq)
        return {"encoder_hidden_states": embeds, "pooled_projections": pooled}

    return encode


def flow_loss(transformer: torch.nn.Module, pair: torch.Tensor, cond: dict[str, torch.Tensor]) -> torch.Tensor:
    """Rectified-flow loss of the target latents of ``pair (B, 2, C, h, w)`` (source, target), with the
    source as context tokens (see the module docstring); σ logit-normal(0, 1)."""
    import torch
    import torch.nn.functional as F

    from pipelines._common import latent_image_ids, pack_2x2

    source, target = pair[:, 0], pair[:, 1]
    b, _, h, w = target.shape
    sigma = torch.sigmoid(torch.randn(b))
    eps = torch.randn(target.shape)
    s = sigma.view(-1, 1, 1, 1)
    noisy = pack_2x2((1 - s) * target + s * eps)
    ids = latent_image_ids(h // 2, w // 2, "cpu", torch.float32)
    context_ids = ids.clone()
    context_ids[..., 0] = 1  # the context image's first position axis, as the pipeline marks it
    embeds = cond["encoder_hidden_states"]
    out = transformer(hidden_states=torch.cat([noisy, pack_2x2(source)], dim=1), timestep=sigma, guidance=None,
                      pooled_projections=cond["pooled_projections"], encoder_hidden_states=embeds,
                      txt_ids=torch.zeros(embeds.shape[1], 3), img_ids=torch.cat([ids, context_ids]),
                      return_dict=False)[0]
    return F.mse_loss(out[:, : noisy.shape[1]].float(), pack_2x2(eps - target).float())


# ------------------------------------------------------------------ export


def sampling_defaults(args: argparse.Namespace, max_seq: int) -> dict:
    """``flowalign.json``: one conditional pass per step, no guidance (see the module docstring)."""
    from pipelines.tiny_twins.flux1 import FLUX_DEFAULTS

    return {"family": NAME, "height": args.size, "width": args.size, "num_frames": None, "guidance_scale": 1.0,
            "num_steps": args.sample_steps, "max_sequence_length": max_seq,
            "shift": FLUX_DEFAULTS["scheduler"]["shift"]}


def demo(folder: Path, data: dict, args: argparse.Namespace, out: Path) -> None:
    """``OUT/samples_train_pairs.png``: for ``--demo-n`` training items, source | edit sampled by the exported
    model | reference edit, two items a row; the instructions in the ``.txt`` beside it."""
    import torch

    import pipelines
    from flowalign.evaluation import sample_seeded
    from pipelines.pretrain.export import save_sheet

    picked = random.Random(12345).sample(range(len(data["prompts"])), args.demo_n)
    source = [data["pixels"][2 * i].float() / 255 for i in picked]
    target = [data["pixels"][2 * i + 1].float() / 255 for i in picked]
    prompts = [data["prompts"][i] for i in picked]
    samples = sample_seeded(pipelines.load(folder), prompts, seed=0, progress=False,
                            metadata=[{"image": image} for image in source])
    png = out / "samples_train_pairs.png"
    save_sheet(torch.stack([x for triple in zip(source, samples, target) for x in triple]), png, cols=6)
    with atomic_path(png.with_suffix(".txt")) as tmp:
        tmp.write_text("\n".join(prompts) + "\n")
