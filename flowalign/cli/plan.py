"""``flowalign plan CONFIG [--gpus N] [--gpu-memory GB] [key=value ...]``: memory per rank before a run."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("plan", help="estimate parameters and memory per rank of a config (meta device, no weights)")
    p.add_argument("config", help="YAML run config, e.g. configs/flux.1-dev/flow_grpo_vvr_fsdp_full.yaml")
    p.add_argument("overrides", nargs="*", help="dotted overrides read as YAML, e.g. model.path=... trainer.batch_size=2; "
                   "model.path=assets/architectures/NAME plans a published model from its configs alone")
    p.add_argument("--gpus", type=int, default=1, help="number of GPUs (ranks) the run would use")
    p.add_argument("--gpu-memory", type=float, default=80.0, help="memory of one GPU in GB (default 80)")
    return p


def run(args: argparse.Namespace) -> None:
    from flowalign.config import load_config
    from flowalign.errors import UserError
    from flowalign.plan import plan_text
    from flowalign.train import check_run, resolve_model_path

    if args.gpus < 1:
        raise UserError(f"--gpus must be at least 1, got {args.gpus}")
    if args.gpu_memory <= 0:
        raise UserError(f"--gpu-memory must be a positive number of GB, got {args.gpu_memory}")
    cfg = load_config(args.config, args.overrides)
    check_run(cfg)  # the whole config, the trainer's section included, as a run would check it
    print(plan_text(cfg, resolve_model_path(cfg.model.path), args.gpus, args.gpu_memory))
