"""The autoencoder stages of a tiny world, shared by the image (SD3) and video (Wan) families.

- ``vae``: the whole VAE on the scenes, foreground-weighted L1 + MSE + a small KL (per-pixel normalised);
- ``decoder``: decoder-only fine-tuning on the cached latents with the encoder frozen, so the latents
  (and a transformer trained on them) keep their meaning; cosine LR to zero and a little latent noise
  for robustness to imperfect samples. It fixes the colour shifts (green, black) a short VAE run leaves.

A family supplies what differs: how a training batch is cut from the scenes, how latents decode, and
how normalised latents map back to the VAE's own (:class:`AutoencoderRecipe`).
"""

from __future__ import annotations

import argparse
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from pipelines.pretrain.data import reconstruction_loss, to_unit
from pipelines.pretrain.stage import LRSchedule, Stage, run_stage

log = logging.getLogger("flowalign.pretrain")


@dataclass
class AutoencoderRecipe:
    """``vae_batch(pixels, fraction) -> x``: a VAE training batch in [-1, 1] (random scenes, crops or
    windows); ``decode(vae, z) -> x``: latents to pixels with gradients (unclamped); ``denormalise(x0) -> z``:
    normalised latents back to the VAE's; ``vae_lr``: the VAE stage's schedule; ``decoder_modules(vae)``:
    what the decoder stage trains; ``decoder_batch``: its batch size; ``log_every``: steps between log lines."""

    vae_batch: Callable[[torch.Tensor, float], torch.Tensor]
    decode: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]
    denormalise: Callable[[torch.Tensor], torch.Tensor]
    vae_lr: LRSchedule
    decoder_modules: Callable[[torch.nn.Module], list[torch.nn.Module]]
    decoder_batch: int
    log_every: int = 50


def adamw(params: list[torch.nn.Parameter], lr: float) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.0, betas=(0.9, 0.99))


def train_vae(vae: torch.nn.Module, pixels: torch.Tensor, args: argparse.Namespace, out: Path,
              recipe: AutoencoderRecipe, on_continue: Callable[[], None] | None = None) -> None:
    """Stage ``vae``: the encoder and decoder on batches of ``pixels`` (uint8 scenes)."""
    params = list(vae.parameters())
    stage = Stage(out / "vae", {"vae": vae}, params, adamw(params, args.vae_lr), args.vae_steps, args.vae_minutes,
                  seed=args.seed, save_every=args.save_every, log_every=recipe.log_every, on_continue=on_continue)

    def loss(fraction: float) -> tuple[torch.Tensor, dict[str, float]]:
        x = recipe.vae_batch(pixels, fraction)
        post = vae.encode(x).latent_dist
        rec = recipe.decode(vae, post.sample())
        kl = post.kl().mean() / x[0].numel()
        return reconstruction_loss(rec, x, args.fg_weight) + args.vae_kl * kl, {"kl": kl.item()}

    vae.train()
    run_stage(stage, loss, recipe.vae_lr, resume=args.resume)
    vae.eval()


def decoder_lr(base: float, warmup: int = 20) -> LRSchedule:
    """Cosine from ``base`` to zero over the budget, after a linear warm-up of ``warmup`` steps."""
    return lambda step, restart, fraction: base * 0.5 * (1 + math.cos(math.pi * fraction)) * min(1.0, (step + 1) / warmup)


def finetune_decoder(vae: torch.nn.Module, pixels: torch.Tensor, x0: torch.Tensor, args: argparse.Namespace,
                     out: Path, recipe: AutoencoderRecipe) -> None:
    """Stage ``decoder``: decoder-only fine-tuning on the cached normalised latents ``x0`` of ``pixels``.
    Skipped without a budget (``--dec-minutes`` / ``--dec-steps``)."""
    if not args.dec_minutes and not args.dec_steps:
        return
    modules = recipe.decoder_modules(vae)
    params = [p for m in modules for p in m.parameters()]
    stage = Stage(out / "decoder", {"vae": vae}, params, adamw(params, args.dec_lr), args.dec_steps, args.dec_minutes,
                  seed=args.seed, save_every=args.save_every, log_every=recipe.log_every)

    def loss(fraction: float) -> tuple[torch.Tensor, dict[str, float]]:
        idx = torch.randint(0, len(pixels), (recipe.decoder_batch,))
        x = to_unit(pixels[idx])
        z = recipe.denormalise(x0[idx] + args.dec_noise * torch.randn(x0[idx].shape))
        return reconstruction_loss(recipe.decode(vae, z), x, args.fg_weight), {}

    for p in params:
        p.requires_grad_(True)
    for m in modules:
        m.train()
    run_stage(stage, loss, decoder_lr(args.dec_lr), resume=args.resume)
    vae.eval().requires_grad_(False)


@torch.no_grad()
def encode_latents(vae, pixels: torch.Tensor, out: Path, normalise: Callable[[torch.Tensor], torch.Tensor],
                   batch: int = 64) -> torch.Tensor:
    """Posterior means of every scene, normalised by ``normalise(z)`` (which sets the VAE's latent factors
    from their statistics when it should), cached in ``OUT/latents.safetensors`` with the factors."""
    import json

    from safetensors.torch import load_file, save_file
    from tqdm import tqdm

    from flowalign.io import atomic_path

    path = out / "latents.safetensors"
    vae.eval()
    if path.is_file():
        from safetensors import safe_open

        with safe_open(str(path), "pt") as f:
            vae.register_to_config(**json.loads(f.metadata()["factors"]))
        return load_file(str(path))["x0"]
    z = torch.cat([vae.encode(to_unit(pixels[i : i + batch])).latent_dist.mean
                   for i in tqdm(range(0, len(pixels), batch), desc="encode latents", mininterval=10)])
    x0 = normalise(z).contiguous()  # conv outputs may be channels-last; the cached copy is not
    factors = {k: v for k, v in vae.config.items() if k in FACTOR_KEYS}
    with atomic_path(path) as tmp:
        save_file({"x0": x0}, str(tmp), metadata={"factors": json.dumps(factors)})
    log.info("latents: %s, factors %s", tuple(z.shape), factors)
    return x0


#: the VAE config keys that hold its latent normalisation (SD3: scalars; Wan: per channel)
FACTOR_KEYS = ("shift_factor", "scaling_factor", "latents_mean", "latents_std")
