"""The tiny Wan-format text-to-video world: what differs from the SD3 family.

Architecture (overrides for :func:`pipelines.tiny.build_tiny_wan`): a Wan 2.1 T2V-like DiT (cross-attention
to UMT5, 3-axis RoPE, qk RMS-norm across heads), 4 layers × width 128 (4 heads × 32); Wan 2.1's causal 3D
VAE with f_t = 2 (the last level halves time) and f_s = 2^(levels − 1); a UMT5 stand-in (width 64,
word-level vocabulary with every training word). Clips are 9 frames of the ``vvr_motion`` benchmark.

The VAE starts *inflated* (:func:`inflate_`: a per-frame autoencoder), trains on random 5-frame windows
(a causal VAE sees a window as a clip; 5 frames cost half of 9) and on the *unclamped* decoder output
(:func:`decode_unclamped`): both were needed for it to learn at all in CPU minutes. Per-channel
``latents_mean`` / ``latents_std`` come from the latent statistics: ``x0 = (z − mean) / std``. The
decoder stage runs after the transformer's (it does not change the latents).
"""

from __future__ import annotations

import argparse
import logging
import math
from typing import TYPE_CHECKING

from flowalign.cli.common import add_number
from flowalign.limits import MAX_COEFFICIENT, MAX_WIDTH

# torch is imported by the functions that train: pretrain-tiny's parser (every --help) reads this module
if TYPE_CHECKING:
    import torch

    from pipelines.pretrain.autoencoder import AutoencoderRecipe

log = logging.getLogger("flowalign.pretrain")

HELP = "the Wan-format text-to-video model on rendered vvr_motion clips (assets/tiny-wan-motion)"
NAME, BENCH, PIPELINE = "wan", "vvr_motion", "WanPipeline"
TRAINED = ("transformer", "text_encoder")
COMPONENTS = ("transformer", "vae", "text_encoder")
EVAL_LEVELS = ("easy", "medium")
DECODER_AFTER_DIT = True  # the decoder stage does not change the latents, so it may come last
NUM_FRAMES = 9  # vvr_motion's clip length (Wan's VAE takes 4k + 1 frames)
VAE_WINDOW = 5  # frames per VAE training clip (1 + 4: one causal chunk after the first frame)
DEFAULTS = dict(out="runs/pretrain-wan", export="assets/tiny-wan-motion", size=32, threads=1, n_scenes=8000,
                mix="easy:0.7,medium:0.3", vae_minutes=25.0, vae_batch=8, vae_lr=3e-3, dit_minutes=50.0,
                batch=32, cfg=4.0, demo_n=8, max_sequence_length=0, dec_minutes=30.0)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options only the Wan family has."""
    p.add_argument("--vae-dim-mult", default="1,2", help="VAE levels (spatial factor 2^(levels-1)); 1,2,2: f_s 4")
    add_number(p, "--z-dim", type=int, lo=1, hi=MAX_WIDTH, default=4, help="VAE latent channels")
    p.add_argument("--patch", default="1,4,4", help="DiT patch (t,h,w); 1,2,2 with --vae-dim-mult 1,2,2")
    add_number(p, "--shift", type=float, lo=0, hi=MAX_COEFFICIENT, lo_open=True, default=1.0, help="sampling shift written to flowalign.json")


def model_overrides(words: list[str], max_length: int, *, vae_dim_mult: tuple[int, ...] = (1, 2),
                    z_dim: int = 4, patch: tuple[int, int, int] = (1, 4, 4)) -> dict:
    """The shipped architecture: f_s 2, z 4, patch (1, 4, 4) on 4×5×16×16 latents = 80 tokens. The first
    version, ``vae_dim_mult=(1, 2, 2), z_dim=8, patch=(1, 2, 2)`` (f_s 4, 8×5×8×8 latents, also 80 tokens),
    blurred 6-11 px objects: its VAE ceiling on easy clips was 44 % (no star survived) against 100 %."""
    temporal = [False] * (len(vae_dim_mult) - 2) + [True]
    return dict(
        seed=0, t5_max_length=max_length, t5_extra_words=tuple(words),
        transformer=dict(patch_size=list(patch), num_attention_heads=4, attention_head_dim=32, freq_dim=64,
                         ffn_dim=512, num_layers=4, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
                         rope_max_seq_len=64),
        vae=dict(base_dim=12, z_dim=z_dim, dim_mult=list(vae_dim_mult), num_res_blocks=1, attn_scales=[],
                 temperal_downsample=temporal),
        text_encoder=dict(d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
                          relative_attention_num_buckets=16, relative_attention_max_distance=64),
        scheduler=dict(shift=1.0),
    )


def build(words: list[str], prompts: list[str], args: argparse.Namespace):
    """A fresh pipeline (its VAE inflated) whose tokenizer knows ``words`` → ``(pipe, max_sequence_length)``."""
    from pipelines.pretrain.data import longest_prompt
    from pipelines.tiny import build_tiny_wan, t5_tokenizer

    max_seq = args.max_sequence_length or longest_prompt(t5_tokenizer(512, tuple(words)), sorted(set(prompts))) + 2
    log.info("max_sequence_length %d", max_seq)
    dim_mult, patch = (tuple(int(v) for v in text.split(",")) for text in (args.vae_dim_mult, args.patch))
    pipe = build_tiny_wan(**model_overrides(words, max_seq, vae_dim_mult=dim_mult, z_dim=args.z_dim, patch=patch))
    inflate_(pipe.vae)
    return pipe, max_seq


def inflate_(vae) -> None:
    """Start the causal 3D VAE as a per-frame image autoencoder [derived; the usual 2D → 3D "inflation"]:
    every causal conv's past taps are zero (only the current frame counts), the encoder's temporal
    downsampling keeps the last frame of each pair and the decoder's temporal upsampling repeats the
    current frame twice. Past taps stay trainable, so video training then learns the temporal mixing
    (in-between frames); a random init instead mixes random past features into every frame, and 340
    steps from it reconstructed no clip the verifier passes."""
    import torch
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d, WanResample

    with torch.no_grad():
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
    import torch

    vae.clear_cache()
    x = vae.post_quant_conv(z)
    frames = []
    for i in range(z.shape[2]):
        vae._conv_idx = [0]
        frames.append(vae.decoder(x[:, :, i : i + 1], feat_cache=vae._feat_map, feat_idx=vae._conv_idx,
                                  first_chunk=i == 0))
    vae.clear_cache()
    return torch.cat(frames, 2)


def channel_stats(vae) -> tuple[torch.Tensor, torch.Tensor]:
    """The VAE's per-channel latent mean and std, shaped ``(1, z, 1, 1, 1)``."""
    import torch

    shape = (1, -1, 1, 1, 1)
    return torch.tensor(vae.config.latents_mean).view(shape), torch.tensor(vae.config.latents_std).view(shape)


def recipe(vae, args: argparse.Namespace) -> AutoencoderRecipe:
    import torch

    from pipelines.pretrain.autoencoder import AutoencoderRecipe
    from pipelines.pretrain.data import to_unit

    def vae_batch(pixels: torch.Tensor, fraction: float) -> torch.Tensor:
        idx = torch.randint(0, len(pixels), (args.vae_batch,))
        start = int(torch.randint(0, NUM_FRAMES - VAE_WINDOW + 1, (1,)))
        return to_unit(pixels[idx, :, start : start + VAE_WINDOW])  # (B, 3, 5, H, W)

    def vae_lr(step: int, restart: int, fraction: float) -> float:
        # high rate, then a cosine down to the low rate over the last 30% (a single high rate leaves colour shifts)
        cool = 1.0 if fraction < 0.7 else 0.5 * (1 + math.cos(math.pi * (fraction - 0.7) / 0.3))
        return (args.vae_lr2 + (args.vae_lr - args.vae_lr2) * cool) * min(1.0, (step + 1) / 20)

    def denormalise(x0: torch.Tensor) -> torch.Tensor:
        mean, std = channel_stats(vae)
        return x0 * std + mean

    return AutoencoderRecipe(vae_batch=vae_batch, decode=decode_unclamped, denormalise=denormalise, vae_lr=vae_lr,
                             decoder_modules=lambda v: [v.decoder, v.post_quant_conv], decoder_batch=args.vae_batch,
                             log_every=25)


def set_latent_factors(vae, z: torch.Tensor, keep: bool = False) -> torch.Tensor:
    """Normalise posterior means ``z (N, z, f, h, w)`` per channel, ``latents_mean`` / ``latents_std`` set
    from their statistics (``keep``: a pretrained VAE keeps its own)."""
    if not keep:
        flat = z.transpose(0, 1).flatten(1)
        vae.register_to_config(latents_mean=[round(float(v), 5) for v in flat.mean(1)],
                               latents_std=[round(float(v), 5) for v in flat.std(1)])
    mean, std = channel_stats(vae)
    return (z - mean) / std


def conditioning(pipe, args: argparse.Namespace, max_seq: int):
    """``prompts → transformer kwargs``: the UMT5 token states from ``encode_prompt`` (with gradients)."""
    import torch

    def encode(prompts: list[str]) -> dict[str, torch.Tensor]:
        embeds, _ = pipe.encode_prompt(prompt=prompts, do_classifier_free_guidance=False,
                                       max_sequence_length=max_seq, device=torch.device("cpu"))
        return {"encoder_hidden_states": embeds}

    return encode


def sampling_defaults(args: argparse.Namespace, max_seq: int) -> dict:
    return {"family": NAME, "height": args.size, "width": args.size, "num_frames": NUM_FRAMES,
            "guidance_scale": args.cfg, "num_steps": args.sample_steps, "max_sequence_length": max_seq,
            "shift": args.shift}
