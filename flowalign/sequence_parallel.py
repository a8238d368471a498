"""Sequence parallelism: the ranks of a group split each sample's tokens, through diffusers' own
context-parallel hooks (``ContextParallelConfig``, ``ModelMixin.enable_parallelism``).

``parallel.sequence_parallel: S`` lays ``N`` processes out as ``N/S`` *data ranks* × ``S`` *sequence
ranks* (process ``r`` is data rank ``r // S``, sequence rank ``r % S``). The ``S`` processes of one data
rank hold the same prompts and noise and run the same passes; inside the transformer each holds ``1/S``
of the tokens: diffusers splits the hidden states along the sequence at the model's input, exchanges
heads for tokens around every attention (Ulysses all-to-all; or passes key/value blocks around a ring)
and gathers the output at the end, so every sequence rank sees the whole velocity. Activations inside
the blocks, what limits long videos, are ``1/S`` per rank.

Gradients: each sequence rank's backward yields its tokens' share of the parameter gradient, and the
group's sum is the whole gradient (tested equal to one process's on the tiny Wan twin). So the step's
gradient is the sum over a data rank's sequence ranks, averaged over data ranks
(:meth:`flowalign.parallel.Parallel.reduce_gradients`). Under ``parallel.strategy=fsdp`` the weights are
sharded over all ``N`` processes (the flattened mesh), as torchtitan shards over its data × context mesh.

Trainers see the data ranks only: :class:`DataRanks` is the accelerator as they use it (rank, rank count,
gathers without the sequence ranks' duplicates), so every trainer runs under sequence parallelism unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from flowalign.errors import UserError

#: the device mesh's dimensions: data ranks, then diffusers' two context-parallel dimensions
MESH_DIMS = ("data", "ring", "ulysses")


@dataclass(frozen=True)
class Layout:
    """Where process ``rank`` of ``world`` sits: data rank ``rank // sequence``, sequence rank ``rank % sequence``."""

    world: int
    rank: int
    sequence: int = 1

    @classmethod
    def of(cls, sequence: int, world: int, rank: int) -> "Layout":
        if sequence > 1 and world % sequence:
            raise UserError(f"parallel.sequence_parallel={sequence} must divide the number of processes ({world}): "
                            f"launch a multiple of {sequence} (torchrun --nproc_per_node {sequence}) or lower "
                            "parallel.sequence_parallel")
        return cls(world, rank, sequence)

    @property
    def data_world(self) -> int:
        return self.world // self.sequence

    @property
    def data_rank(self) -> int:
        return self.rank // self.sequence

    @property
    def sequence_rank(self) -> int:
        return self.rank % self.sequence


def device_mesh(layout: Layout, device_type: str, attention: str) -> Any:
    """The ``(data, ring, ulysses)`` mesh: ``(N/S, 1, S)`` for Ulysses attention, ``(N/S, S, 1)`` for ring."""
    from torch.distributed.device_mesh import init_device_mesh

    s = layout.sequence
    shape = (layout.data_world, 1, s) if attention == "ulysses" else (layout.data_world, s, 1)
    return init_device_mesh(device_type, shape, mesh_dim_names=MESH_DIMS)


def split_sequences(module: nn.Module, mesh: Any, attention: str) -> None:
    """Have ``module`` (a diffusers transformer) split its tokens over the mesh's sequence ranks, in place.

    Refuses (``UserError``) a model diffusers gives no context-parallel plan, a head count the Ulysses degree
    does not divide, and ring attention on a backend that cannot return the log-sum-exp ring attention merges with.
    """
    name = type(module).__name__
    if getattr(module, "_cp_plan", None) is None or not hasattr(module, "enable_parallelism"):
        raise UserError(f"parallel.sequence_parallel: diffusers gives {name} no context-parallel plan (_cp_plan), so "
                        "its tokens cannot be split; use parallel.sequence_parallel=1 with this model family")
    s = mesh["ring"].size() * mesh["ulysses"].size()
    heads = getattr(getattr(module, "config", None), "num_attention_heads", None)
    if attention == "ulysses" and heads is not None and heads % s:
        raise UserError(f"parallel.sequence_parallel={s}: Ulysses attention gives each rank {heads}/{s} of {name}'s "
                        f"attention heads, which does not divide; choose a degree dividing {heads} or "
                        "parallel.sequence_parallel_attention=ring")
    if attention == "ring" and attention_backend(module) == "native":
        raise UserError(f"parallel.sequence_parallel_attention=ring needs an attention backend that returns the "
                        "log-sum-exp, which diffusers' native backend cannot: set model.attention_backend (flash, "
                        "_native_cudnn or sage, on a GPU) or use parallel.sequence_parallel_attention=ulysses")
    from diffusers import ContextParallelConfig

    config = ContextParallelConfig(mesh=mesh, **{f"{attention}_degree": s})
    with _one_device_per_process():
        module.enable_parallelism(config=config)


def attention_backend(module: nn.Module) -> str:
    """The attention backend ``module``'s processors run (the active one when they name none)."""
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    for m in module.modules():
        backend = getattr(getattr(m, "processor", None), "_attention_backend", None)
        if backend is not None:
            return str(getattr(backend, "value", backend))
    return str(_AttentionBackendRegistry.get_active_backend()[0].value)


@contextmanager
def _one_device_per_process() -> Iterator[None]:
    """diffusers picks a process's device as ``rank % torch.accelerator.device_count()``, which divides by
    zero on a machine without an accelerator; there each process counts as holding one device (its CPU).
    On an accelerator nothing changes."""
    if torch.accelerator.device_count() > 0:
        yield
        return
    count = torch.accelerator.device_count
    torch.accelerator.device_count = lambda: 1
    try:
        yield
    finally:
        torch.accelerator.device_count = count


class DataRanks:
    """The accelerator as trainers use it under sequence parallelism: ``process_index`` and
    ``num_processes`` count data ranks, and gathers keep one copy per data rank (a data rank's sequence
    ranks hold the same values). Everything else is the accelerator's own."""

    def __init__(self, accelerator: Any, layout: Layout):
        self._acc, self._layout = accelerator, layout

    def __getattr__(self, name: str) -> Any:
        return getattr(self._acc, name)

    @property
    def process_index(self) -> int:
        return self._layout.data_rank

    @property
    def num_processes(self) -> int:
        return self._layout.data_world

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every data rank's ``tensor`` (the same shape on each) concatenated along dim 0 in rank order."""
        full = self._acc.gather(tensor)
        per_process = full.reshape(self._layout.world, -1, *tensor.shape[1:]) if tensor.ndim else full.reshape(-1, 1)
        kept = per_process[:: self._layout.sequence]
        return kept.flatten(0, 1) if tensor.ndim else kept.reshape(-1)

    def reduce(self, tensor: torch.Tensor, reduction: str = "sum") -> torch.Tensor:
        """Over data ranks: a sum counts each data rank once."""
        out = self._acc.reduce(tensor, reduction=reduction)
        return out / self._layout.sequence if reduction == "sum" else out
