"""Arguments and loading shared by the sub-commands that run a model."""

from __future__ import annotations

import argparse
from pathlib import Path

from flowalign.errors import UserError
from flowalign.paths import default_model_dir


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="diffusers model folder (default: the embedded tiny model)")
    p.add_argument("--adapter", default=None, help="LoRA adapter folder or a checkpoints/step-XXXXXX folder")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])


def load_policy(args: argparse.Namespace):
    """Load ``--model`` (and ``--adapter``) through the pipelines registry."""
    import pipelines

    model = Path(args.model) if args.model else default_model_dir()
    policy = pipelines.load(model, device=args.device, dtype=args.dtype)
    if args.adapter:
        if not Path(args.adapter).exists():
            raise UserError(f"--adapter {args.adapter}: no such folder; give a saved adapter or a checkpoints/step-XXXXXX folder")
        policy.load_adapter(args.adapter)
    return policy
