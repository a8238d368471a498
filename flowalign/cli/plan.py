"""``flowalign plan CONFIG [--gpus N] [--gpu-memory GB] [key=value ...]``: memory per rank before a run."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from flowalign.cli.common import add_number
from flowalign.limits import MAX_GPU_MEMORY_GB, MAX_RANKS

if TYPE_CHECKING:
    from flowalign.config import TrainConfig


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("plan", help="estimate parameters and memory per rank of a config (meta device, no weights)")
    p.add_argument("config", help="YAML run config, e.g. configs/flux.1-dev/flow_grpo_vvr_fsdp_full.yaml; a recipe "
                   "whose model.path does not exist is planned on assets/architectures/<its configs/ folder>")
    p.add_argument("overrides", nargs="*", help="dotted overrides read as YAML, e.g. model.path=... trainer.batch_size=2; "
                   "model.path=assets/architectures/NAME plans a published model from its configs alone")
    add_number(p, "--gpus", type=int, lo=1, hi=MAX_RANKS, default=1, help="number of GPUs (ranks) the run would use")
    add_number(p, "--gpu-memory", type=float, lo=0, hi=MAX_GPU_MEMORY_GB, lo_open=True, default=80.0,
               help="memory of one GPU in GB (default 80)")
    return p


def run(args: argparse.Namespace) -> None:
    from flowalign.config import load_config
    from flowalign.plan import plan_text, planning_folder
    from flowalign.train import check_run

    cfg = load_config(args.config, args.overrides)
    path_given = any(o.split("=", 1)[0].strip() in ("model", "model.path") for o in args.overrides)
    folder, note = planning_folder(cfg.model.path, args.config, path_given)
    if note:
        print(note, flush=True)  # the first line, before anything the checks print
    check_run(without_data_files(cfg, folder))  # the config's checks, as a run would make them
    print(plan_text(cfg, folder, args.gpus, args.gpu_memory))


def without_data_files(cfg: "TrainConfig", folder: Path) -> "TrainConfig":
    """``cfg`` on ``folder`` with its prompt files set aside: memory needs no prompts, and a recipe's names
    a placeholder path. Training draws one task of the built-in benchmark instead; evaluation (when it has
    rewards to score with, which ``check_run`` asks of a prompt file) the benchmark's split."""
    data, evaluation = cfg.data, cfg.eval
    if data.prompts:
        data = data.model_copy(update={"prompts": None, "bench": "vvr", "level": "easy"})
    if evaluation.prompts and evaluation.rewards:
        evaluation = evaluation.model_copy(update={"prompts": None, "bench": "vvr", "level": "easy"})
    model = cfg.model.model_copy(update={"path": str(folder)})
    return cfg.model_copy(update={"model": model, "data": data, "eval": evaluation})
