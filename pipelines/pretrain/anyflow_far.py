"""The tiny AnyFlow-FAR streaming text-to-video world: what differs from the Wan family.

Data: the same rendered ``vvr_motion`` training clips as the Wan family (9 frames, task seeds < 1000).

Components: taken from the shipped tiny Wan model (``--init-from``, default ``assets/tiny-wan-motion``):
its causal 3D VAE (frozen, with its latent factors), its UMT5 stand-in and tokenizer, and its
transformer's weights as the start of a fresh ``AnyFlowFARTransformer3DModel`` of the same width and depth
(:func:`warm_start`). That is how the released AnyFlow-FAR checkpoints were made: FAR turns a pretrained
Wan 2.1 DiT causal, adding a compressed patch embedding for far context and, for AnyFlow, a second
timestep embedding. The compressed embedding starts as the full one's kernel resized (the transformer's
own constructor does this from whatever full kernel it has, so it is redone after the weights are loaded);
the second timestep embedding starts as a copy of the first, so that at ``r = t`` the model's time
conditioning is exactly the Wan model's.

Training (:func:`flow_loss`): rectified flow on one chunk at a time given the *clean* chunks before it,
through the stream's own two calls: the cache step writes the clean history's keys and values (chunks
beyond ``full_chunk_limit`` back in compressed form), then the noised chunk reads them, with gradients
through both, so the model learns to write the history it later reads. Why not FAR's one-pass
clean-context layout (``clean_hidden_states``): in diffusers the cache-reading call pads its keys to a
multiple of 128 with zeros and, having no mask, attends to them, while the one-pass layout masks the
padding. At real sizes that is ~100 zero keys among thousands; at 16 tokens a frame it is most of the keys,
and a model trained one way is a different function the other way (measured: 0.16 largest velocity
difference on the tiny twin). Trained on the very calls it samples with, the model has no such gap. The
model is trained as a plain flow (``r = t``, target ``ε − x0``), not distilled into a flow map, so it samples with
its instantaneous velocity over ``--sample-steps`` Euler steps per chunk (``use_mean_velocity`` false in
``flowalign.json``). The text encoder trains jointly, as in the Wan family.

flex attention has no backward on CPU; the transformer trains through
:class:`pipelines.anyflow_far.CausalAttentionOnSDPA` (the cache step's block mask, evaluated densely).
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from flowalign.cli.common import add_number
from flowalign.limits import MAX_COEFFICIENT, MAX_FRAMES
from flowalign.errors import UserError

# torch and diffusers are imported by the functions that train: pretrain-tiny's parser (every --help) reads
# this module
if TYPE_CHECKING:
    import torch

log = logging.getLogger("flowalign.pretrain")

HELP = "the AnyFlow-FAR-format streaming video model on rendered vvr_motion clips (assets/tiny-anyflow-far-motion)"
NAME, BENCH, PIPELINE = "anyflow_far", "vvr_motion", "AnyFlowFARPipeline"
TRAINED = ("transformer", "text_encoder")
COMPONENTS = ("transformer", "vae", "text_encoder")
EVAL_LEVELS = ("easy", "medium")
DECODER_AFTER_DIT = True
NUM_FRAMES = 9  # vvr_motion's clip length: 5 latent frames
DEFAULTS = dict(out="runs/pretrain-anyflow-far", export="assets/tiny-anyflow-far-motion", size=32, threads=1,
                n_scenes=8000, mix="easy:0.7,medium:0.3", vae_minutes=0.0, vae_batch=8, vae_lr=3e-3,
                dit_minutes=30.0, batch=32, cfg=4.0, demo_n=8, max_sequence_length=0, dec_minutes=0.0)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options only the AnyFlow-FAR family has."""
    p.add_argument("--init-from", default="assets/tiny-wan-motion",
                   help="the tiny Wan folder whose VAE, UMT5 stand-in, tokenizer and transformer weights are reused")
    p.add_argument("--chunk-partition", default="1,2,2", help="latent frames per streamed chunk (sum: 5)")
    add_number(p, "--full-chunk-limit", type=int, lo=0, hi=MAX_FRAMES, default=2,
                   help="chunks kept at full resolution; earlier ones enter as compressed far context")
    p.add_argument("--compressed-patch", default="1,8,8", help="patch (t,h,w) of the compressed far context")
    add_number(p, "--shift", type=float, lo=0, hi=MAX_COEFFICIENT, lo_open=True, default=1.0, help="sampling shift written to flowalign.json")


def check(args: argparse.Namespace) -> None:
    """Bad values as one-line errors, before anything is rendered."""
    index = Path(args.init_from or "") / "model_index.json"
    if not index.is_file() or json.loads(index.read_text()).get("_class_name") != "WanPipeline":
        raise UserError(f"--init-from {args.init_from!r}: give a tiny Wan folder (e.g. assets/tiny-wan-motion) whose "
                        "VAE, text encoder and transformer the streaming model starts from")
    frames = sum(parse_ints(args.chunk_partition, "--chunk-partition"))
    if frames != (NUM_FRAMES - 1) // 2 + 1:
        raise UserError(f"--chunk-partition {args.chunk_partition}: the chunks must cover the 5 latent frames of a "
                        f"{NUM_FRAMES}-frame clip (e.g. 1,2,2)")
    parse_ints(args.compressed_patch, "--compressed-patch")


def parse_ints(text: str, flag: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise UserError(f"{flag} {text!r}: give comma-separated integers, e.g. 1,2,2") from None
    if not values or min(values) < 1:
        raise UserError(f"{flag} {text!r}: every value must be a positive integer")
    return values


# ------------------------------------------------------------------ model


def load_pretrained(folder: Path, args: argparse.Namespace, prompts: list[str]):
    """An ``AnyFlowFARPipeline`` of ``folder``'s (a tiny Wan model's) VAE, text encoder and tokenizer and a
    causal transformer warm-started from its transformer → ``(pipe, max_sequence_length)``."""
    from diffusers import AnyFlowFARPipeline, AutoencoderKLWan, FlowMapEulerDiscreteScheduler, WanTransformer3DModel
    from transformers import AutoTokenizer, UMT5EncoderModel

    from pipelines.anyflow_far import attend_with_sdpa
    from pipelines.pretrain.data import longest_prompt

    tokenizer = AutoTokenizer.from_pretrained(folder / "tokenizer")
    settings = json.loads((folder / "flowalign.json").read_text()) if (folder / "flowalign.json").is_file() else {}
    max_seq = args.max_sequence_length or int(settings.get("max_sequence_length") or 0) or \
        longest_prompt(tokenizer, sorted(set(prompts))) + 2
    log.info("max_sequence_length %d", max_seq)
    transformer = warm_start(WanTransformer3DModel.from_pretrained(folder / "transformer"),
                             parse_ints(args.chunk_partition, "--chunk-partition"), args.full_chunk_limit,
                             parse_ints(args.compressed_patch, "--compressed-patch"))
    attend_with_sdpa(transformer)  # training on CPU: flex attention has no backward there
    pipe = AnyFlowFARPipeline(tokenizer=tokenizer, text_encoder=UMT5EncoderModel.from_pretrained(folder / "text_encoder"),
                              transformer=transformer, vae=AutoencoderKLWan.from_pretrained(folder / "vae"),
                              scheduler=FlowMapEulerDiscreteScheduler(num_train_timesteps=1000, shift=args.shift))
    return pipe, max_seq


def warm_start(wan, chunk_partition: tuple[int, ...], full_chunk_limit: int, compressed_patch: tuple[int, ...]):
    """A fresh ``AnyFlowFARTransformer3DModel`` of ``wan``'s sizes holding its weights (see the module docstring)."""
    import torch
    import torch.nn.functional as F
    from diffusers import AnyFlowFARTransformer3DModel

    with torch.no_grad():
        c = wan.config
        far = AnyFlowFARTransformer3DModel(
            patch_size=tuple(c.patch_size), compressed_patch_size=tuple(compressed_patch),
            full_chunk_limit=full_chunk_limit, num_attention_heads=c.num_attention_heads,
            attention_head_dim=c.attention_head_dim, in_channels=c.in_channels, out_channels=c.out_channels,
            text_dim=c.text_dim, freq_dim=c.freq_dim, ffn_dim=c.ffn_dim, num_layers=c.num_layers,
            cross_attn_norm=c.cross_attn_norm, eps=c.eps, rope_max_seq_len=c.rope_max_seq_len,
            chunk_partition=tuple(chunk_partition))
        loaded = far.load_state_dict(wan.state_dict(), strict=False)
        new = {"far_patch_embedding.weight", "far_patch_embedding.bias"} | \
            {f"condition_embedder.delta_embedder.{k}" for k in far.condition_embedder.delta_embedder.state_dict()}
        if loaded.unexpected_keys or set(loaded.missing_keys) != new:
            raise UserError(f"the Wan transformer does not map onto AnyFlow-FAR: missing {loaded.missing_keys}, "
                            f"unexpected {loaded.unexpected_keys}")
        inner = c.num_attention_heads * c.attention_head_dim
        kernel = far.patch_embedding.weight.view(-1, 1, *c.patch_size)
        resized = F.interpolate(kernel, size=tuple(compressed_patch), mode="trilinear", align_corners=False)
        far.far_patch_embedding.weight.copy_(resized.view(inner, c.in_channels, *compressed_patch))
        far.far_patch_embedding.bias.copy_(far.patch_embedding.bias)
        far.condition_embedder.delta_embedder.load_state_dict(far.condition_embedder.time_embedder.state_dict())
        return far


def recipe(vae, args: argparse.Namespace):
    """The Wan family's autoencoder recipe (no VAE or decoder stage runs by default: the VAE comes pretrained)."""
    from pipelines.pretrain import wan

    return wan.recipe(vae, args)


def set_latent_factors(vae, z: torch.Tensor, keep: bool = True) -> torch.Tensor:
    """The pretrained VAE's own per-channel latent factors."""
    from pipelines.pretrain import wan

    return wan.set_latent_factors(vae, z, keep=True)


# ------------------------------------------------------------------ training


def conditioning(pipe, args: argparse.Namespace, max_seq: int):
    """The Wan family's: the UMT5 token states from the pipeline's ``encode_prompt`` (with gradients)."""
    from pipelines.pretrain import wan

    return wan.conditioning(pipe, args, max_seq)


def streamed_velocity(transformer: torch.nn.Module, clip: torch.Tensor, k: int, noisy: torch.Tensor, t: torch.Tensor,
                      text: torch.Tensor) -> torch.Tensor:
    """The velocity ``(B, f_k, C, H', W')`` of chunk ``k``'s noised frames ``noisy`` (FAR layout) at timesteps
    ``t (B,)`` (``r = t``), after the clean chunks ``0..k−1`` of ``clip (B, F, C, H', W')``: the stream's own two
    calls (the cache step over the clean history, then the chunk reading it), with gradients through both."""
    from pipelines.anyflow_far import empty_cache_layers, read_cache_velocity, write_cache

    partition = list(transformer.config.chunk_partition)
    layers = empty_cache_layers(transformer.config, len(clip), clip.shape[-2:], partition, clip.device, clip.dtype)
    if k:
        write_cache(transformer, layers, partition[:k], clip[:, : sum(partition[:k])], text)
    return read_cache_velocity(transformer, layers, partition[:k], noisy, t, t, text)


def flow_loss(transformer: torch.nn.Module, x: torch.Tensor, cond: dict[str, torch.Tensor]) -> torch.Tensor:
    """Rectified-flow loss of one chunk, drawn uniformly, of clean latents ``x (B, C, F', H', W')`` given the clean
    chunks before it (see the module docstring); σ logit-normal(0, 1) per sample."""
    import torch
    import torch.nn.functional as F

    partition = list(transformer.config.chunk_partition)
    k = int(torch.randint(len(partition), ()))
    clip = x.permute(0, 2, 1, 3, 4)  # (B, F, C, H, W), the FAR layout
    start = sum(partition[:k])
    target_chunk = clip[:, start : start + partition[k]]
    sigma = torch.sigmoid(torch.randn(len(x)))
    eps = torch.randn(target_chunk.shape)
    s = sigma.view(-1, 1, 1, 1, 1)
    out = streamed_velocity(transformer, clip, k, (1 - s) * target_chunk + s * eps, 1000 * sigma,
                            cond["encoder_hidden_states"])
    return F.mse_loss(out.float(), (eps - target_chunk).float())


# ------------------------------------------------------------------ export


def sampling_defaults(args: argparse.Namespace, max_seq: int) -> dict:
    """``flowalign.json``: Euler steps of the instantaneous velocity per chunk, CFG against the empty prompt."""
    return {"family": NAME, "height": args.size, "width": args.size, "num_frames": NUM_FRAMES,
            "guidance_scale": args.cfg, "num_steps": args.sample_steps, "max_sequence_length": max_seq,
            "shift": args.shift, "chunk_partition": list(parse_ints(args.chunk_partition, "--chunk-partition")),
            "use_mean_velocity": False}
