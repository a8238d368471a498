"""The tiny SD3-format text-to-image world: what differs from the Wan family.

Architecture (overrides for :func:`pipelines.tiny.build_tiny_sd3`): an SD3.5-Large-like MMDiT (qk RMS-norm,
no dual attention), 4 layers × width 128, patch 2 on ``size/4`` latents with 4 channels; an f4 SD3-style
VAE; CLIP-L/G stand-ins (width 64, real CLIP BPE truncated to 16k tokens) and a T5 stand-in (width 128,
word-level vocabulary with every training word). The VAE trains on random 32 px crops at a high rate,
then on full scenes at a low rate (a single high rate shifts colours); its ``shift_factor`` /
``scaling_factor`` come from the latent statistics: ``x0 = (z − shift)·scale``.

``--init-from FOLDER`` continues a pretrained model instead: its VAE (with its own latent factors) and
tokenizers stay, its transformer (deepened with ``--num-layers``, see :func:`deepen_transformer`) and
text encoders keep training on freshly rendered scenes, its decoder optionally too.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
from pathlib import Path
from typing import TYPE_CHECKING

from flowalign.cli.common import add_number
from flowalign.limits import MAX_BATCH, MAX_LAYERS, MAX_SEQUENCE_LENGTH, MAX_TINY_SIDE

# torch is imported by the functions that train: pretrain-tiny's parser (every --help) reads this module
if TYPE_CHECKING:
    import torch

    from pipelines.pretrain.autoencoder import AutoencoderRecipe

log = logging.getLogger("flowalign.pretrain")

HELP = "the SD3-format text-to-image model on rendered vvr scenes (assets/tiny-sd3-vvr)"
NAME, BENCH, PIPELINE = "sd3", "vvr", "StableDiffusion3Pipeline"
TRAINED = ("transformer", "text_encoder", "text_encoder_2", "text_encoder_3")
COMPONENTS = ("transformer", "vae", "text_encoder", "text_encoder_2", "text_encoder_3")
EVAL_LEVELS = ("easy", "medium", "hard")
DECODER_AFTER_DIT = False
DEFAULTS = dict(out="runs/pretrain-tiny", export="assets/tiny-sd3-vvr", size=64, threads=2, n_scenes=30000,
                mix="easy:0.45,medium:0.4,hard:0.15", vae_minutes=10.0, vae_batch=32, vae_lr=2e-3, dit_minutes=30.0,
                batch=64, cfg=3.0, demo_n=16, max_sequence_length=None)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options only the SD3 family has."""
    p.add_argument("--synthetic", action="store_true", help="own coloured-shape scenes instead of the vvr benchmark's")
    add_number(p, "--clip-max-length", type=int, lo=0, hi=MAX_SEQUENCE_LENGTH, default=48, help="CLIP tokenizer length (0: longest prompt)")
    add_number(p, "--dec-batch", type=int, lo=1, hi=MAX_BATCH, default=16)
    add_number(p, "--vae-crop", type=int, lo=0, hi=MAX_TINY_SIDE, default=32, help="crop size in the first LR stage (0: full images)")
    add_number(p, "--pooled-drop", type=float, lo=0, hi=1, default=0.0,
                   help="rate at which only the pooled text vector is replaced by the empty prompt's, so the "
                        "transformer learns to read the prompt's tokens (multi-object binding)")
    p.add_argument("--init-from", default=None,
                   help="continue from a pretrained folder (e.g. assets/tiny-sd3-vvr): its VAE and tokenizers "
                        "are kept as they are (no VAE stage), the transformer and text encoders train on "
                        "freshly rendered scenes")
    add_number(p, "--num-layers", type=int, lo=1, hi=MAX_LAYERS, default=None,
                   help="with --init-from: deepen the transformer to this many joint blocks (a multiple of its "
                        "own), the new ones starting as the identity")


def model_overrides(words: list[str], clip_max_length: int, t5_max_length: int, size: int = 64) -> dict:
    """The shipped architecture (see the module docstring)."""
    return dict(
        seed=0, height=size, clip_vocab_size=16384, clip_max_length=clip_max_length, t5_max_length=t5_max_length,
        t5_extra_words=tuple(words),
        transformer=dict(patch_size=2, in_channels=4, out_channels=4, num_layers=4, attention_head_dim=32,
                         num_attention_heads=4, caption_projection_dim=128, pos_embed_max_size=16,
                         qk_norm="rms_norm", dual_attention_layers=[]),
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


def build(words: list[str], prompts: list[str], args: argparse.Namespace):
    """A fresh pipeline whose tokenizers know ``words`` and fit ``prompts`` → ``(pipe, max_sequence_length)``."""
    from pipelines.pretrain.data import longest_prompt
    from pipelines.tiny import build_tiny_sd3, clip_tokenizer

    clip_len = args.clip_max_length
    if not clip_len:  # the longest of (at most) 5,000 prompts, in whole multiples of 8 tokens
        sampled = prompts[:: max(1, len(prompts) // 5000)]
        clip_len = int(math.ceil((longest_prompt(clip_tokenizer(16384, 1000), sampled) + 4) / 8) * 8)
    max_seq = args.max_sequence_length or clip_len
    log.info("clip_max_length %d, max_sequence_length %d", clip_len, max_seq)
    return build_tiny_sd3(**model_overrides(words, clip_len, max_seq, args.size)), max_seq


def load_pretrained(folder: Path, args: argparse.Namespace, prompts: list[str] | None = None):
    """``--init-from``: the pretrained pipeline (deepened with ``--num-layers``) → ``(pipe, max_sequence_length)``;
    its tokenizers stay as they are, whatever the ``prompts``."""
    from diffusers import StableDiffusion3Pipeline

    pipe = StableDiffusion3Pipeline.from_pretrained(folder)
    if args.num_layers and args.num_layers != pipe.transformer.config.num_layers:
        log.info("deepening the transformer %d -> %d joint blocks (new blocks start as the identity)",
                 pipe.transformer.config.num_layers, args.num_layers)
        pipe.transformer = deepen_transformer(pipe.transformer, args.num_layers)
    return pipe, json.loads((folder / "flowalign.json").read_text())["max_sequence_length"]


def deepen_transformer(old, num_layers: int):
    """A deeper copy of an ``SD3Transformer2DModel`` that computes exactly the same function.

    Old block ``k`` of ``L`` goes to position ``(k + 1)·num_layers/L − 1`` (so the last, context-pre-only
    block stays last); the new blocks in between get zero adaLN modulation (DiT's adaLN-Zero), which
    makes a joint block the identity on both streams until training moves its gates. Everything else
    (patch and time/text embeddings, output head) is copied.
    """
    import torch
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


def recipe(vae, args: argparse.Namespace) -> AutoencoderRecipe:
    import torch

    from pipelines.pretrain.autoencoder import AutoencoderRecipe
    from pipelines.pretrain.data import to_unit

    size = args.size

    def vae_batch(pixels: torch.Tensor, fraction: float) -> torch.Tensor:
        x = to_unit(pixels[torch.randint(0, len(pixels), (args.vae_batch,))])
        c = args.vae_crop
        if fraction < 0.6 and c and c < size:
            # the high-rate stage on random crops (the VAE is fully convolutional; 4x cheaper at 32 px)
            i, j = (int(v) for v in torch.randint(0, (size - c) // 4 + 1, (2,)) * 4)
            x = x[:, :, i : i + c, j : j + c]
        return x

    def vae_lr(step: int, restart: int, fraction: float) -> float:
        # two LR stages: high rate, then a low rate for the last 40% (fixes colour shifts)
        return (args.vae_lr if fraction < 0.6 else args.vae_lr2) * min(1.0, (step + 1) / 100)

    return AutoencoderRecipe(
        vae_batch=vae_batch,
        decode=lambda v, z: v.decode(z).sample,
        denormalise=lambda x0: x0 / vae.config.scaling_factor + vae.config.shift_factor,
        vae_lr=vae_lr,
        decoder_modules=lambda v: [v.decoder] + ([v.post_quant_conv] if v.post_quant_conv is not None else []),
        decoder_batch=args.dec_batch,
    )


def set_latent_factors(vae, z: torch.Tensor, keep: bool) -> torch.Tensor:
    """Normalise posterior means ``z (N, 4, h, w)``: ``(z − shift)·scale`` with the factors set from their
    mean and 1/std (``keep``: a pretrained VAE keeps its own, which its transformer was trained with)."""
    if keep:
        shift, scale = float(vae.config.shift_factor), float(vae.config.scaling_factor)
    else:
        shift, scale = float(z.mean()), float(1.0 / z.std())
        vae.register_to_config(shift_factor=shift, scaling_factor=scale)
    return (z - shift) * scale


def conditioning(pipe, args: argparse.Namespace, max_seq: int):
    """``prompts → transformer kwargs``: the token sequence and the pooled vector from ``encode_prompt``."""
    import torch

    def encode(prompts: list[str]) -> dict[str, torch.Tensor]:
        pe, _, pooled, _ = pipe.encode_prompt(prompt=prompts, prompt_2=None, prompt_3=None,
                                              do_classifier_free_guidance=False, max_sequence_length=max_seq,
                                              device=torch.device("cpu"))
        if args.pooled_drop > 0:
            # the pooled CLIP vector conditions every token through adaLN and is a shortcut that a
            # one-object prompt can be drawn from; without it the model must read the token sequence
            # through attention, which is where two objects' colours and shapes are bound to them
            _, _, empty_pooled, _ = pipe.encode_prompt(prompt=[""], prompt_2=None, prompt_3=None,
                                                       do_classifier_free_guidance=False,
                                                       max_sequence_length=max_seq, device=torch.device("cpu"))
            hide = torch.rand(len(prompts)) < args.pooled_drop
            pooled = torch.where(hide[:, None], empty_pooled.expand_as(pooled), pooled)
        return {"encoder_hidden_states": pe, "pooled_projections": pooled}

    return encode


def sampling_defaults(args: argparse.Namespace, max_seq: int) -> dict:
    return {"family": NAME, "height": args.size, "width": args.size, "num_frames": None,
            "guidance_scale": args.cfg, "num_steps": args.sample_steps, "max_sequence_length": max_seq, "shift": 1.0}
