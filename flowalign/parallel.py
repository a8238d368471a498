"""Work shared over ranks: replicated weights (:class:`DDP`) or torch FSDP2 sharding (:class:`FSDP`), one
strategy object per run (:func:`strategy`) whose methods are the operations that differ.

``ddp`` keeps the whole model and optimiser on every rank and the loop averages gradients itself.
``fsdp`` calls ``torch.distributed.fsdp.fully_shard`` on every transformer block, then on the
transformer: each rank stores ``1/N`` of every weight, gradient and optimiser tensor, gathers a block's
weights just before the block runs and reduce-scatters (averages) its gradients right after backward.
The module keeps its identity, so the policy's own ``self.transformer(...)`` call runs sharded.

``parallel.sequence_parallel: S`` composes with either: each data rank's samples are split token-wise over
``S`` processes (:mod:`flowalign.sequence_parallel`), ``fsdp`` then shards over all processes.

Under ``fsdp`` every forward is a collective: all ranks must run the same passes in the same order.
Checkpoints stay consolidated (full tensors gathered to rank 0) and the optimiser state goes through
``torch.distributed.checkpoint`` (one shard file per rank, re-sharded on load to any rank count).
"""

from __future__ import annotations

import datetime
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from flowalign.config import ParallelSection
from flowalign.errors import UserError
from flowalign.sequence_parallel import MESH_DIMS, Layout, device_mesh, split_sequences

#: attribute names of the repeated-block lists of diffusers transformers (SD3/FLUX: transformer_blocks,
#: FLUX: single_transformer_blocks, Wan: blocks), used when a model names no ``_no_split_modules``
BLOCK_LISTS = ("transformer_blocks", "single_transformer_blocks", "blocks", "layers")
#: subfolder of a checkpoint holding the sharded optimiser state
OPTIMIZER_DIR = "optimizer"


def accelerator_kwargs(cfg: ParallelSection) -> list[Any]:
    """``Accelerator(kwargs_handlers=...)`` giving collectives the configured timeout."""
    from accelerate.utils import InitProcessGroupKwargs

    return [InitProcessGroupKwargs(timeout=datetime.timedelta(seconds=cfg.timeout_s))]


@contextmanager
def process_group_released() -> Iterator[None]:
    """Destroy the default process group when the block ends, however it ends: wrap the whole of a process's
    runs (a group is made once per process and shared by them). A gloo process that exits
    with its group alive can abort (SIGABRT, "terminate called without an active exception") while the
    interpreter tears down: its worker threads still hold tensors. Destroying it here, with the
    interpreter alive, makes the exit clean; in a single process there is no group and nothing to do."""
    try:
        yield
    finally:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def block_modules(module: nn.Module) -> list[nn.Module]:
    """The transformer's repeated blocks, each one FSDP unit.

    diffusers names its block classes in ``_no_split_modules`` (``JointTransformerBlock``,
    ``FluxTransformerBlock`` + ``FluxSingleTransformerBlock``, ``WanTransformerBlock``); a model without
    it falls back to the usual block-list attributes (:data:`BLOCK_LISTS`).
    """
    names = set(getattr(module, "_no_split_modules", None) or [])
    found = [m for m in module.modules() if m is not module and type(m).__name__ in names]
    if found:
        return found
    lists = [getattr(module, n) for n in BLOCK_LISTS if isinstance(getattr(module, n, None), nn.ModuleList)]
    return [block for blocks in lists for block in blocks]


def stream_blocks(module: nn.Module, device: torch.device) -> None:
    """``module`` (in CPU memory) runs on ``device`` holding one block there at a time: everything but its
    blocks moves to ``device``; each block moves there just before its forward and back just after."""
    blocks = block_modules(module)
    in_blocks = {id(t) for block in blocks for t in (*block.parameters(), *block.buffers())}
    for t in (*module.parameters(), *module.buffers()):
        if id(t) not in in_blocks:
            t.data = t.data.to(device)

    def load(block: nn.Module, args: Any) -> None:
        block.to(device)

    def unload(block: nn.Module, args: Any, out: Any) -> None:
        block.to("cpu")

    for block in blocks:
        block.register_forward_pre_hook(load)
        block.register_forward_hook(unload)


def is_dtensor(t: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def strategy(cfg: ParallelSection, world: int, rank: int, device: torch.device | str) -> Parallel:
    """The run's strategy object: :class:`FSDP` for ``parallel.strategy=fsdp``, else :class:`DDP`."""
    return (FSDP if cfg.strategy == "fsdp" else DDP)(cfg, world, rank, device)


class Parallel:
    """How the ranks of a run share the work: what both strategies do alike (gathering objects and
    tensors, rank folders, failures), and the operations each strategy defines (:class:`DDP`, :class:`FSDP`)."""

    #: whether each rank holds only a shard of the weights (then every forward is a collective)
    sharded: bool = False

    def __init__(self, cfg: ParallelSection, world: int, rank: int, device: torch.device | str):
        self.cfg, self.world, self.rank, self.device = cfg, world, rank, torch.device(device)
        #: data ranks × sequence ranks (one sequence rank per data rank without sequence parallelism)
        self.layout = Layout.of(cfg.sequence_parallel, world, rank)
        self._mesh: Any = None

    @property
    def mesh(self) -> Any:
        """The ``(data, ring, ulysses)`` device mesh of sequence parallelism (built once, a collective)."""
        if self._mesh is None:
            self._mesh = device_mesh(self.layout, self.device.type, self.cfg.sequence_parallel_attention)
        return self._mesh

    def split_sequences(self, module: nn.Module) -> nn.Module:
        """With ``parallel.sequence_parallel`` > 1, ``module``'s tokens split over each data rank's sequence
        ranks (in place; returns ``module``)."""
        if self.layout.sequence > 1:
            split_sequences(module, self.mesh, self.cfg.sequence_parallel_attention)
        return module

    # ------------------------------------------------------------------ what the strategies define
    def shard(self, module: nn.Module, offload: bool | None = None) -> nn.Module:
        """Lay ``module`` out over the ranks (in place; returns ``module``)."""
        raise NotImplementedError

    def place_frozen(self, module: nn.Module, device: torch.device, offload: bool) -> nn.Module:
        """Lay out a frozen copy of the trained modules (full fine-tuning's reference) as the policy is laid
        out: ``module`` is on the policy's ``device``, or in CPU memory when ``offload`` (then kept there
        between its forwards). In place; returns ``module``."""
        raise NotImplementedError

    def reduce_gradients(self, params: list[nn.Parameter]) -> None:
        """Make every rank's gradients the average over ranks (before clipping)."""
        raise NotImplementedError

    def clip_grad_norm(self, params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
        """Clip to ``max_norm`` over all ranks' gradients; the pre-clip norm (same on every rank), a 0-dim
        tensor on the gradients' device (reading it back would make the host wait for the backward)."""
        raise NotImplementedError

    def checksum(self, params: list[nn.Parameter]) -> torch.Tensor:
        """``(1,)`` float64 sum of the weights: this rank's copy (ddp), or the whole sharded model (fsdp)."""
        raise NotImplementedError

    def padded(self, items: list[Any], fill: Callable[[], Any]) -> list[Any]:
        """``items``, filled up with ``fill()`` where every rank must run as many forwards and optimiser
        steps (fsdp)."""
        raise NotImplementedError

    def takes_part(self) -> bool:
        """Whether this rank runs work whose result only the main rank keeps (evaluation, writing the
        adapter): the main rank alone, or every rank when forwards and gathers are collectives (fsdp)."""
        raise NotImplementedError

    def save_optimizer(self, folder: Path, module: nn.Module, optimizer: torch.optim.Optimizer) -> bool:
        """Write the optimiser state to ``folder/optimizer/`` on every rank (fsdp); False when it goes in
        the checkpoint's single file instead (ddp: the main process writes it)."""
        raise NotImplementedError

    def load_indexed_optimizer(self, module: nn.Module, optimizer: torch.optim.Optimizer,
                               indexed: dict[str, Any]) -> None:
        """Restore a single-file optimiser state (keyed by parameter index)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ shared
    def gather_objects(self, obj: Any) -> list[Any]:
        """Every data rank's ``obj`` (picklable), in rank order; ``[obj]`` in one process. A collective (of
        all processes: a data rank's sequence ranks hold the same ``obj``, kept once)."""
        return self.every_process(obj)[:: self.layout.sequence]

    def every_process(self, obj: Any) -> list[Any]:
        """Every process's ``obj`` (picklable), sequence ranks included, in rank order. A collective."""
        if self.world < 2:
            return [obj]
        out: list[Any] = [None] * self.world
        torch.distributed.all_gather_object(out, obj)
        return out

    def total(self, n: int) -> int:
        """``n`` summed over data ranks (a collective when there are several processes)."""
        return int(sum(self.gather_objects(int(n))))

    def average_gradients(self, params: list[nn.Parameter]) -> None:
        """Make the gradients of a module every process holds whole, outside the policy's layout (e.g. a
        trainer's own critic), their mean over all processes: one all-reduce of the flattened gradients (a
        missing one counts as zeros), nothing in one process. A data rank's sequence ranks compute the same
        gradient from the same samples, so this is also the mean over data ranks. A collective."""
        if self.world < 2:
            return
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        flat = torch.cat([p.grad.detach().reshape(-1).float() for p in params]).to(self.device)
        torch.distributed.all_reduce(flat, torch.distributed.ReduceOp.SUM)
        flat /= self.world
        offset = 0
        for p in params:
            n = p.grad.numel()
            p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
            offset += n

    def gather(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Full CPU tensors of ``tensors`` (sharded ones gathered) on the main rank, ``{}`` elsewhere.

        A collective under fsdp: every rank calls it with the same keys in the same order.
        """
        out = {}
        for name, t in tensors.items():
            full = t.detach().full_tensor() if is_dtensor(t) else t.detach()
            if self.rank == 0:
                out[name] = full.cpu().contiguous()
        return out

    def place(self, full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """``full`` laid out as ``like`` (this rank's shard of it when ``like`` is sharded), ready for ``copy_``."""
        if not is_dtensor(like):
            return full
        from torch.distributed.tensor import distribute_tensor

        return distribute_tensor(full.to(like.device, like.dtype), like.device_mesh, like.placements, src_data_rank=None)

    def place_like(self, saved: dict[str, torch.Tensor], live: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Full ``saved`` tensors laid out like their ``live`` namesakes (see :meth:`place`)."""
        return {k: self.place(v, live[k]) if k in live else v for k, v in saved.items()}

    def load_optimizer(self, folder: Path, module: nn.Module, optimizer: torch.optim.Optimizer,
                       indexed: dict[str, Any] | None) -> None:
        """Restore the optimiser from either layout: the sharded ``optimizer/`` folder (any rank count,
        re-sharded by ``torch.distributed.checkpoint``) or the single-file state keyed by parameter index."""
        if not (folder / OPTIMIZER_DIR).is_dir():
            self.load_indexed_optimizer(module, optimizer, indexed)
            return
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

        state = {"optimizer": get_optimizer_state_dict(module, optimizer)}  # allocates, then filled in place
        dcp.load(state, checkpoint_id=str(folder / OPTIMIZER_DIR))
        set_optimizer_state_dict(module, optimizer, state["optimizer"])

    @contextmanager
    def rank_folder(self, run_dir: Path) -> Iterator[Path]:
        """``run_dir`` on the main rank; a scratch folder, deleted after, on the others (their copies of
        work every rank must run under fsdp, such as evaluation, are not kept)."""
        if self.rank == 0:
            yield run_dir
            return
        with tempfile.TemporaryDirectory(prefix="flowalign-rank") as tmp:
            yield Path(tmp)

    @contextmanager
    def explain_failures(self) -> Iterator[None]:
        """A collective that fails because another rank died or stalled past ``parallel.timeout_s``
        becomes a one-line error saying so (and how to continue), instead of a backend traceback."""
        try:
            yield
        except (torch.distributed.DistError, RuntimeError) as err:
            if self.world < 2 or not is_collective_failure(err):
                raise
            first = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
            raise UserError(
                f"rank {self.rank}: lost contact with the other ranks ({first}); a rank died or stalled longer than "
                f"parallel.timeout_s={self.cfg.timeout_s:g}: relaunch with run.resume=auto to continue from the last "
                "complete checkpoint") from err


class DDP(Parallel):
    """Replicated weights: every rank holds the whole model and optimiser; gradients are averaged here."""

    def shard(self, module: nn.Module, offload: bool | None = None) -> nn.Module:
        return self.split_sequences(module)

    def place_frozen(self, module: nn.Module, device: torch.device, offload: bool) -> nn.Module:
        """Each rank holds the whole copy; offloaded, its blocks visit ``device`` one at a time."""
        if offload:
            stream_blocks(module, device)
        return self.split_sequences(module)

    def reduce_gradients(self, params: list[nn.Parameter]) -> None:
        """The sum over all processes, divided by the data ranks: a data rank's sequence ranks each hold their
        tokens' share of its gradient."""
        if self.world < 2:
            return
        for p in params:
            grad = torch.zeros_like(p) if p.grad is None else p.grad.clone()
            torch.distributed.all_reduce(grad, torch.distributed.ReduceOp.SUM)
            grad /= self.layout.data_world
            p.grad = grad

    def clip_grad_norm(self, params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(params, max_norm)

    def checksum(self, params: list[nn.Parameter]) -> torch.Tensor:
        return torch.stack([p.detach().double().sum() for p in params]).sum().reshape(1)

    def padded(self, items: list[Any], fill: Callable[[], Any]) -> list[Any]:
        return list(items)  # a rank's forwards are its own: nothing to fill (``fill`` is not called)

    def takes_part(self) -> bool:
        return self.layout.data_rank == 0  # with sequence parallelism its forwards are its sequence ranks' collectives

    def save_optimizer(self, folder: Path, module: nn.Module, optimizer: torch.optim.Optimizer) -> bool:
        return False

    def load_indexed_optimizer(self, module: nn.Module, optimizer: torch.optim.Optimizer,
                               indexed: dict[str, Any]) -> None:
        optimizer.load_state_dict(indexed)


class FSDP(Parallel):
    """torch FSDP2: each rank stores ``1/N`` of every weight, gradient and optimiser tensor."""

    sharded = True

    def __init__(self, cfg: ParallelSection, world: int, rank: int, device: torch.device | str):
        if world < 2:
            raise UserError("parallel.strategy=fsdp needs several processes but this run has 1: launch with "
                            "torchrun --nproc_per_node N (N >= 2), or set parallel.strategy=ddp")
        super().__init__(cfg, world, rank, device)
        self._shard_mesh: Any = None

    def shard(self, module: nn.Module, offload: bool | None = None) -> nn.Module:
        """``fully_shard`` each block, then the root. ``offload``: keep the shards in CPU memory (default:
        ``parallel.cpu_offload``)."""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        self.split_sequences(module)
        if self._shard_mesh is None:  # sequence parallelism: sharded over every process, data and sequence ranks
            self._shard_mesh = (self.mesh[MESH_DIMS]._flatten("shard") if self.layout.sequence > 1
                                else init_device_mesh(self.device.type, (self.world,)))
        mesh = self._shard_mesh
        mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
              if self.cfg.mixed_precision == "bf16" else MixedPrecisionPolicy())
        offload = self.cfg.cpu_offload if offload is None else offload
        offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if offload else OffloadPolicy()
        kw = dict(mesh=mesh, reshard_after_forward=self.cfg.reshard_after_forward, mp_policy=mp, offload_policy=offload)
        blocks = block_modules(module)
        if not blocks:
            print(f"warning: {type(module).__name__} has no block list to shard one by one; sharding it as one "
                  "unit (every forward gathers all of its weights at once)")
        for block in blocks:
            fully_shard(block, **kw)
        fully_shard(module, **kw)
        return module

    def place_frozen(self, module: nn.Module, device: torch.device, offload: bool) -> nn.Module:
        """Sharded like the policy (``1/N`` per rank, gathered block by block); offloaded, the shards stay in
        CPU memory (FSDP2's CPU offload)."""
        return self.shard(module, offload=offload)

    def reduce_gradients(self, params: list[nn.Parameter]) -> None:
        """FSDP reduce-scatters (averages over all processes) each block's gradients during backward; a data
        rank's gradient is its sequence ranks' sum, so that average is ``1/S`` of the mean over data ranks.
        (Gloo has no pre-scaled sum for FSDP's own divide factor: the factor is applied here.)"""
        if self.layout.sequence > 1:
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(self.layout.sequence)

    def clip_grad_norm(self, params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
        grads = [p.grad for p in params if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads)
        if is_dtensor(norm):
            norm = norm.full_tensor()  # the shards' partial norms combined
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
        return norm

    def checksum(self, params: list[nn.Parameter]) -> torch.Tensor:
        local = [p.to_local() if is_dtensor(p) else p for p in params]
        total = torch.stack([t.detach().double().sum() for t in local]).sum().reshape(1)
        torch.distributed.all_reduce(total)
        return total

    def padded(self, items: list[Any], fill: Callable[[], Any]) -> list[Any]:
        """``items`` filled up with ``fill()`` to the longest list of any rank: every forward is a collective."""
        most = torch.tensor([len(items)], dtype=torch.int64, device=self.device)
        torch.distributed.all_reduce(most, op=torch.distributed.ReduceOp.MAX)
        missing = int(most) - len(items)
        return list(items) + ([fill()] * missing if missing else [])

    def takes_part(self) -> bool:
        return True

    def save_optimizer(self, folder: Path, module: nn.Module, optimizer: torch.optim.Optimizer) -> bool:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        dcp.save({"optimizer": get_optimizer_state_dict(module, optimizer)}, checkpoint_id=str(folder / OPTIMIZER_DIR))
        return True

    def load_indexed_optimizer(self, module: nn.Module, optimizer: torch.optim.Optimizer,
                               indexed: dict[str, Any]) -> None:
        """A single-process checkpoint: parameter i of the trained ones is the i-th name."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        names = [n for n, p in module.named_parameters() if p.requires_grad]
        full = {"state": {names[int(i)]: s for i, s in indexed["state"].items()},
                "param_groups": [{**g, "params": [names[int(i)] for i in g["params"]]} for g in indexed["param_groups"]]}
        set_optimizer_state_dict(module, optimizer, full, options=StateDictOptions(full_state_dict=True))


#: words of the errors torch's process groups raise when a peer is gone or a collective timed out
_COLLECTIVE_WORDS = ("gloo", "nccl", "connection closed", "connection reset", "broken pipe", "timed out", "timeout",
                     "processgroup", "tcpstore", "socket")


def is_collective_failure(err: BaseException) -> bool:
    """Whether ``err`` is a process-group failure (a lost peer or a timed-out collective)."""
    if isinstance(err, torch.distributed.DistError):
        return True
    text = str(err).lower()
    return any(word in text for word in _COLLECTIVE_WORDS)
