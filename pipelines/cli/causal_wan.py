"""``flowalign causal-wan CHECKPOINT --wan DIR --out DIR``: a causal Wan generator's release (Self-Forcing,
LongLive, Causal-Forcing) as a folder ``model.path`` loads as a streaming policy
(:mod:`pipelines.causal_wan_checkpoint`).

A folder holding other files is refused without ``--overwrite``; the folder it wrote before is its own.
"""

from __future__ import annotations

import argparse

from flowalign.cli.common import add_number
from flowalign.cli.out_dir import add_out_dir_args


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("causal-wan", help="convert a Self-Forcing / LongLive / Causal-Forcing generator checkpoint "
                                          "into a streaming Wan folder (offline)")
    p.add_argument("checkpoint", help="the generator checkpoint (self_forcing_dmd.pt, longlive_base.pt, ...)")
    p.add_argument("--wan", required=True, help="the Wan2.1-T2V-1.3B-Diffusers folder it was trained from (UMT5, "
                                                "VAE and tokenizer are taken from it)")
    add_out_dir_args(p, "folder to write (give it as model.path)", "only its files are replaced")
    p.add_argument("--ema", action="store_true", help="take the checkpoint's generator_ema weights")
    p.add_argument("--lora", help="a LoRA to merge into the generator (LongLive's lora.pt)")
    add_number(p, "--lora-alpha", type=float, lo=1e-6, hi=1e6, default=None,
               help="the LoRA's alpha (default: its rank, as LongLive's release)")
    add_number(p, "--attention-window", type=int, lo=1, hi=10_000, default=None,
               help="local attention in latent frames (LongLive: 12); default: every frame (Self-Forcing)")
    add_number(p, "--sink-frames", type=int, lo=0, hi=10_000, default=0,
               help="frames kept at the start of the window (LongLive: 3)")
    p.add_argument("--trust-pickle", action="store_true",
                   help="read a checkpoint that holds more than tensors and plain values (a pickle can run code)")
    return p


def run(args: argparse.Namespace) -> None:
    from flowalign.io import check_out_dir
    from pipelines.causal_wan_checkpoint import WRITER, convert_checkpoint

    check_out_dir(args.out, writer=WRITER, overwrite=args.overwrite)  # before the checkpoint is read
    out = convert_checkpoint(args.checkpoint, args.wan, args.out, ema=args.ema, lora=args.lora,
                             lora_alpha=args.lora_alpha, attention_window=args.attention_window,
                             sink_frames=args.sink_frames, overwrite=args.overwrite, trust_pickle=args.trust_pickle)
    print(f"wrote the streaming Wan generator to {out} (train or sample it with model.path: {out})")
