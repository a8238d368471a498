"""``Parallel.average_gradients``: the mean over processes of a module every process holds whole (a
trainer's own critic), one flat all-reduce; nothing in one process (two gloo processes on CPU)."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import torch
import torch.distributed as dist

from flowalign.config import ParallelSection
from flowalign.parallel import strategy
from tests.warm_start import spawn


def _critic() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))


def _rank_gradients(critic: torch.nn.Module, rank: int) -> None:
    """Rank ``r``'s gradient of every parameter: ``(r + 1)·(index + 1)`` times a fixed pattern; the second
    layer's bias has none on rank 0 (a parameter a rank's loss did not reach)."""
    for i, p in enumerate(critic.parameters()):
        if rank == 0 and i == 3:
            p.grad = None
            continue
        p.grad = (rank + 1) * (i + 1) * torch.arange(p.numel(), dtype=p.dtype).reshape(p.shape)


def test_one_process_keeps_its_gradients_as_they_are():
    critic = _critic()
    _rank_gradients(critic, 1)
    before = [p.grad.clone() for p in critic.parameters()]
    strategy(ParallelSection(), 1, 0, torch.device("cpu")).average_gradients(list(critic.parameters()))
    assert all(torch.equal(p.grad, b) for p, b in zip(critic.parameters(), before))


def _average(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    critic = _critic()
    _rank_gradients(critic, rank)
    strategy(ParallelSection(), world, rank, torch.device("cpu")).average_gradients(list(critic.parameters()))
    Path(out, f"rank{rank}.json").write_text(json.dumps([p.grad.tolist() for p in critic.parameters()]))
    dist.destroy_process_group()


def test_two_processes_hold_the_mean_of_their_gradients(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    spawn(_average, (2, port, str(tmp_path)), 2)
    got = [[torch.tensor(g) for g in json.loads((tmp_path / f"rank{r}.json").read_text())] for r in range(2)]
    want = []
    for i, p in enumerate(_critic().parameters()):
        pattern = (i + 1) * torch.arange(p.numel(), dtype=p.dtype).reshape(p.shape)
        ranks = [0.0 if i == 3 else 1.0, 2.0]  # rank 0 had no gradient for the last bias: zeros in the mean
        want.append(pattern * sum(ranks) / 2)
    for r in range(2):
        for g, w in zip(got[r], want):
            assert torch.allclose(g, w)
    assert all(torch.equal(a, b) for a, b in zip(got[0], got[1]))
