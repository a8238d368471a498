"""A device that is not the CPU, on a machine that has only a CPU: tensors that hold real CPU data but say
they are on ``meta``, and that refuse to mix with CPU tensors the way CUDA tensors do.

A CPU-only test suite cannot see a tensor made on the CPU and mixed with the model's tensors: there every
tensor is on the CPU. Under :class:`FakeDevice`, ``torch.zeros(n, device=x.device)`` and ``t.to(device)``
give :class:`OnDevice` tensors (the arithmetic still runs on the CPU, so values, ``.item()`` and gradients
are real), and an operation that meets an :class:`OnDevice` tensor and a CPU tensor of one or more dimensions
raises CUDA's ``Expected all tensors to be on the same device`` error. What CUDA accepts is accepted: a CPU
0-dimensional tensor (a scalar) in any operation, CPU indices into a device tensor, copies between devices.
A factory that draws on the device from a CPU generator fails as on CUDA. A list index (``x[[0, 2]]``) is
made an index tensor here, as on CUDA, where PyTorch gives a ``meta`` tensor's index list no data; a lazily
conjugated view (``conj()``, in the gradient of a complex product) is read as its values, as CUDA's kernels
read it.

:func:`host_waits` records, while on, each operation that on CUDA makes the host wait for the device: reading
a value (``.item()``, ``float()``, ``bool()``, ``.tolist()``), a copy to the CPU, a blocking copy to the device
(``torch.tensor(x, device=...)``, ``t.to(device)`` without ``non_blocking``) and an operation whose output
size depends on the values (``nonzero``, a boolean mask index).

``meta`` is the device these tensors claim because it exists in every PyTorch build and has the device
bookkeeping (autograd's device threads, device guards) that a made-up device lacks; no real meta tensor is
ever created while the mode is on.
"""

from __future__ import annotations

import sys
import threading
import traceback
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

DEVICE = torch.device("meta")

aten = torch.ops.aten
#: operations CUDA runs with a CPU tensor among device tensors: copies between devices, and CPU index
#: tensors into a device tensor (the indexed tensor must be the device one, checked below)
CROSS_DEVICE = {aten._to_copy.default, aten.copy_.default, aten._copy_from.default,
                aten._copy_from_and_resize.default, aten.lift_fresh.default, aten.lift_fresh_copy.default}
INDEXING = {aten.index.Tensor, aten.index_put_.default, aten.index_put.default, aten._index_put_impl_.default}


class OnDevice(torch.Tensor):
    """A CPU tensor ``elem`` that reports :data:`DEVICE` as its device."""

    elem: torch.Tensor

    @staticmethod
    def __new__(cls, elem: torch.Tensor) -> "OnDevice":
        out = torch.Tensor._make_wrapper_subclass(
            cls, elem.size(), strides=elem.stride(), storage_offset=elem.storage_offset(), dtype=elem.dtype,
            layout=elem.layout, device=DEVICE, requires_grad=elem.requires_grad)
        out.elem = elem
        return out

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __repr__(self) -> str:
        return f"OnDevice({self.elem!r})"

    def tolist(self) -> Any:  # PyTorch refuses it on subclasses; a CUDA tensor copies to the CPU first
        _record("read values")
        return self.elem.tolist()

    # PyTorch turns an index list into a tensor on the indexed tensor's device, and for ``meta`` it makes an
    # empty one (no data to copy): the rows picked would be garbage. A CUDA tensor's list gets its values.
    def __getitem__(self, index: Any) -> Any:
        return super().__getitem__(_index_lists_as_tensors(index))

    def __setitem__(self, index: Any, value: Any) -> None:
        super().__setitem__(_index_lists_as_tensors(index), value)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return run(func, args, kwargs or {})


def _as_tuple(index: list) -> bool:
    """Whether PyTorch reads a list index as a tuple of indices (one per dimension) rather than one index
    list: a short list holding a sequence, tensor, slice, ``...`` or None (``treatSequenceAsTuple``)."""
    return len(index) < 32 and any(isinstance(i, (list, tuple, torch.Tensor, slice)) or i is Ellipsis or i is None
                                   for i in index)


def _index_tensor(seq: list | tuple) -> torch.Tensor:
    """A CPU index tensor of ``seq`` as PyTorch makes it: bool (a mask) or uint8 kept, any other type int64."""
    t = torch.tensor(seq)
    return t if t.dtype in (torch.bool, torch.uint8) else t.long()


def _index_lists_as_tensors(index: Any) -> Any:
    """``index`` with its lists of positions as CPU index tensors (which CUDA takes into a device tensor)."""
    if isinstance(index, list) and not _as_tuple(index):
        return _index_tensor(index)
    if isinstance(index, (list, tuple)):
        return tuple(_index_tensor(i) if isinstance(i, (list, tuple)) else i for i in index)
    return index


def on_device(device: Any) -> bool:
    return device is not None and torch.device(device).type == DEVICE.type


def _unwrap(x: Any) -> Any:
    """The CPU data of ``x``, a lazily conjugated or negated view (``conj()``, autograd's complex formulas) read
    as its values: PyTorch calls ``__torch_dispatch__`` with its Conjugate and Negative keys off, so a CPU
    kernel given the view itself would ignore the bit (``g * f.conj()`` would compute ``g * f``)."""
    if not isinstance(x, OnDevice):
        return x
    return x.elem.resolve_conj().resolve_neg() if x.elem.is_conj() or x.elem.is_neg() else x.elem


def _argument(func, args: tuple, kwargs: dict, name: str) -> Any:
    for i, a in enumerate(func._schema.arguments):
        if a.name == name:
            return args[i] if i < len(args) else kwargs.get(name)
    return None


def _tensors(x: Any, out: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors in an operation's arguments (lists, tuples, dicts), cheaper than a pytree walk."""
    if isinstance(x, torch.Tensor):
        out.append(x)
    elif isinstance(x, (list, tuple)):
        for y in x:
            _tensors(y, out)
    elif isinstance(x, dict):
        for y in x.values():
            _tensors(y, out)
    return out


def _map(fn: Any, x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return fn(x)
    if type(x) in (list, tuple):
        return type(x)(_map(fn, y) for y in x)
    if isinstance(x, dict):
        return {k: _map(fn, y) for k, y in x.items()}
    return x


def mixed_devices(func, args: tuple, kwargs: dict, tensors: list[torch.Tensor]) -> str | None:
    """Why CUDA would refuse ``func`` on these arguments (None: it would not)."""
    if on_device(kwargs.get("device")):
        generator = kwargs.get("generator")
        if generator is not None and generator.device.type == "cpu":
            return f"Expected a '{DEVICE.type}' device type for generator but found 'cpu' ({func})"
    if func in CROSS_DEVICE or not any(type(t) is OnDevice for t in tensors):
        return None
    empty = [t for t in tensors if type(t) is not OnDevice and t.device.type == DEVICE.type]
    if empty:  # a factory this module does not intercept made it: add it to FROM_DATA (indices too: no garbage)
        return f"a data-less {DEVICE.type} tensor of shape {tuple(empty[0].shape)} reached {func}"
    if func in INDEXING:
        if isinstance(args[0], OnDevice):
            return None  # CPU indices into a device tensor: CUDA moves them
        return f"indices should be either on cpu or on the same device as the indexed tensor (cpu) ({func})"
    host = [t for t in tensors if type(t) is not OnDevice and t.dim() > 0]
    if host:
        return (f"Expected all tensors to be on the same device, but found at least two devices, {DEVICE.type} "
                f"and {host[0].device.type}! (when running {func}, a CPU tensor of shape {tuple(host[0].shape)})")
    return None


#: the lists :func:`host_waits` is filling (one per open block)
_RECORDERS: list[list[tuple[str, str]]] = []
#: operations whose output size depends on the values: the host reads them back to size the result
DATA_DEPENDENT = {aten.nonzero.default, aten.masked_select.default, aten._unique2.default, aten.unique_dim.default,
                  aten.unique_consecutive.default, aten.repeat_interleave.Tensor}
#: operations that return a Python value computed from the data (CUDA reads it back; ``_local_scalar_dense`` is
#: not dispatched inside them)
READS = {aten.equal.default, aten.allclose.default, aten.is_nonzero.default}
COPIES = {aten._to_copy.default, aten.copy_.default}
REPO = str(Path(__file__).resolve().parents[2])


@contextmanager
def host_waits() -> Iterator[list[tuple[str, str]]]:
    """``(kind, where)`` for each operation on fake-device tensors, inside the block, that on CUDA makes the host
    wait for the device (``where``: the innermost line of this repository's code outside the tests)."""
    found: list[tuple[str, str]] = []
    _RECORDERS.append(found)
    try:
        yield found
    finally:
        _RECORDERS.remove(found)


def _record(kind: str) -> None:
    if not _RECORDERS:
        return
    where = "?"
    for frame in reversed(traceback.extract_stack()[:-2]):
        if frame.filename.startswith(REPO) and "/tests/" not in frame.filename and "/.venv/" not in frame.filename:
            where = f"{frame.filename[len(REPO) + 1:]}:{frame.lineno}"
            break
    for found in _RECORDERS:
        found.append((kind, where))


def _waits(func, args: tuple, kwargs: dict, wrapped: bool) -> str | None:
    """What makes the host wait in ``func`` on CUDA (None: nothing)."""
    if func in COPIES:
        src, dst = (args[0], kwargs.get("device")) if func is aten._to_copy.default else (args[1], args[0].device)
        to_device, from_device = on_device(dst or getattr(src, "device", None)), type(src) is OnDevice
        if from_device and not to_device:
            return "copy to the host"
        if to_device and not from_device and not kwargs.get("non_blocking", len(args) > 2 and args[2]):
            return "blocking copy to the device"
        return None
    if not wrapped:
        return None
    if func is aten._local_scalar_dense.default or func in READS:
        return "read a value"
    if func in DATA_DEPENDENT:
        return "value-dependent size"
    if func in INDEXING and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] if i is not None):
        return "value-dependent size"
    return None


def run(func, args: tuple, kwargs: dict) -> Any:
    """``func`` on the CPU data, its tensor results on the fake device when an input was (or ``device=`` says so)."""
    tensors = _tensors(args, _tensors(kwargs, []))
    device = kwargs.get("device")
    wrapped = any(type(t) is OnDevice for t in tensors)
    if not wrapped and not on_device(device):
        return func(*args, **kwargs)  # the CPU's own work
    if _RECORDERS:
        kind = _waits(func, args, kwargs, wrapped)
        if kind:
            _record(kind)
    why = mixed_devices(func, args, kwargs, tensors)
    if why is not None:
        raise RuntimeError(why)
    to_device = on_device(device) or (device is None and wrapped)
    schema = func._schema
    mutated = [_argument(func, args, kwargs, a.name) for a in schema.arguments
               if a.alias_info is not None and a.alias_info.is_write]
    if any(isinstance(m, OnDevice) and (m.elem.is_conj() or m.elem.is_neg()) for m in mutated):
        # _unwrap reads such a view as a copy of its values: a write into it would be lost
        raise RuntimeError(f"{func} writes into a lazily conjugated or negated view, which the fake device does not emulate")
    if on_device(device):
        kwargs = {**kwargs, "device": torch.device("cpu")}
    out = func(*_map(_unwrap, args), **_map(_unwrap, kwargs))
    if schema.returns and all(r.alias_info is not None and r.alias_info.is_write for r in schema.returns):
        # in place (or out=): the results are the mutated arguments themselves, whatever their device
        return mutated[0] if len(mutated) == 1 else tuple(mutated)
    if not to_device:
        return out
    return _map(lambda x: x if type(x) is OnDevice else OnDevice(x), out)


class _Dispatch(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return run(func, args, kwargs or {})


#: factories that turn Python data into a tensor without going through the dispatcher on the way to ``device``
FROM_DATA = {torch.tensor, torch.as_tensor, torch.asarray, torch.Tensor.new_tensor, torch.scalar_tensor}


class _FromData(TorchFunctionMode):
    """``torch.tensor(data, device=DEVICE)`` and its kin: made on the CPU, then moved (through the dispatcher)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in FROM_DATA and on_device(kwargs.get("device")):
            if args and isinstance(args[0], torch.Tensor):  # a tensor already: moved (never read as raw memory)
                dtype = kwargs.get("dtype")
                return args[0].to(device=DEVICE, dtype=args[0].dtype if dtype is None else dtype)
            # a list of device scalars is read back value by value, as CUDA reads it
            return func(_on_host(args[0]), *args[1:], **{**kwargs, "device": "cpu"}).to(DEVICE)
        return func(*args, **kwargs)


def _on_host(data: Any) -> Any:
    """``data`` (nested lists and tuples) with its tensors copied to the CPU."""
    if isinstance(data, torch.Tensor):
        return data.cpu()
    if isinstance(data, (list, tuple)):
        return type(data)(_on_host(x) for x in data)
    return data


class FakeDevice:
    """While on, tensors made on or moved to :data:`DEVICE` are :class:`OnDevice` (real data, CUDA's rules)."""

    def __enter__(self) -> "FakeDevice":
        self._modes = _enter_modes()
        # modes are per thread: threads started meanwhile (the reward worker) enter them at their first call
        self._profile = threading.getprofile()
        threading.setprofile(_in_new_thread)
        return self

    def __exit__(self, *exc: Any) -> None:
        threading.setprofile(self._profile)
        for mode in reversed(self._modes):
            mode.__exit__(*exc)


def _enter_modes() -> list[Any]:
    modes = [_Dispatch(), _FromData()]
    for mode in modes:
        mode.__enter__()
    return modes


def _in_new_thread(frame: Any, event: str, arg: Any) -> None:
    """Profile hook of a new thread: the modes on at its first call (``Thread.run``), off when that returns."""
    modes = _enter_modes()

    def leave(f: Any, ev: str, a: Any) -> None:
        if ev == "return" and f is frame:
            sys.setprofile(None)
            for mode in reversed(modes):
                mode.__exit__(None, None, None)

    sys.setprofile(leave)
