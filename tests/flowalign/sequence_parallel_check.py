"""Run under ``torchrun --nproc_per_node 2``: the tiny Wan policy with its tokens split over the two ranks
(parallel.sequence_parallel=2, under each strategy named) against the same policy whole on each rank. Writes
``OUT/STRATEGY/rank{r}.json``: the velocities' largest difference, the gradients' largest relative difference
after the strategy's reduction, and the refusals of what cannot run here.

    torchrun --standalone --nproc_per_node 2 -m tests.flowalign.sequence_parallel_check OUT STRATEGY...
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import pipelines
from flowalign.config import ParallelSection
from flowalign.errors import UserError
from flowalign.parallel import strategy
from flowalign.paths import assets_dir


def policy():
    torch.manual_seed(0)  # the same adapter initialisation in both copies
    return pipelines.load(assets_dir() / "tiny-wan-motion", lora={"rank": 4, "alpha": 4.0})


def loss_and_velocity(p, x, sigma, cond):
    v = p.velocity(x, sigma, cond, guidance=1.0)
    return (v * torch.linspace(-1, 1, v.numel()).reshape(v.shape)).sum(), v.detach()


def check(out: Path, kind: str) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = ParallelSection(strategy=kind, sequence_parallel=2)
    split, whole = policy(), policy()
    with torch.no_grad():  # the adapters start at zero (lora_B): give them values so their gradients are not trivial
        for a, b in zip(split.trainable.parameters(), whole.trainable.parameters(), strict=True):
            if a.requires_grad:
                a.copy_(torch.randn(a.shape, generator=torch.Generator().manual_seed(a.numel())) * 0.05)
                b.copy_(a)
    parallel = strategy(cfg, world, rank, "cpu")
    parallel.shard(split.trainable)
    cond = split.encode(["a red ball moves left", "a blue cube moves up"])
    x = split.initial_noise(2, torch.Generator().manual_seed(1))
    loss_split, v_split = loss_and_velocity(split, x, 0.6, cond)
    loss_whole, v_whole = loss_and_velocity(whole, x, 0.6, cond)
    loss_split.backward()
    loss_whole.backward()
    params = [p for p in split.trainable.parameters() if p.requires_grad]
    parallel.reduce_gradients(params)
    grads = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad)
             for n, p in split.trainable.named_parameters() if p.requires_grad}
    relative = max(((grads[n] - p.grad).abs().max() / p.grad.abs().max()).item()
                   for n, p in whole.trainable.named_parameters() if p.requires_grad)
    refusals = {}
    try:
        strategy(ParallelSection(sequence_parallel=2, sequence_parallel_attention="ring"), world, rank, "cpu").shard(policy().trainable)
    except UserError as err:
        refusals["ring"] = str(err)
    result = {"velocity_max_diff": (v_split - v_whole).abs().max().item(), "velocity_scale": v_whole.abs().max().item(),
              "gradient_max_relative_diff": relative, "refusals": refusals}
    (out / kind).mkdir(parents=True, exist_ok=True)
    (out / kind / f"rank{rank}.json").write_text(json.dumps(result))


def main() -> None:
    dist.init_process_group("gloo")
    for kind in sys.argv[2:]:  # every strategy in one launch: start-up paid once
        check(Path(sys.argv[1]), kind)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
