"""The transformer's model FLOPs as a run spends them, for ``perf/tflops_per_s`` and ``perf/mfu``.

What a step computes depends on the trainer (rows per pass, passes with and without gradients), so the FLOPs
are counted where they are spent: every call of the transformer adds the FLOPs of one forward at the call's
input shapes, three times that when gradients are on (a backward costs about two forwards: the usual MFU
convention, whether or not the base weights are frozen). Recomputation under gradient checkpointing is not
model work and is not counted.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from flowalign.logger import diffusers_warnings_off
from flowalign.model_signature import input_signature, model_class, model_signature

log = logging.getLogger(__name__)

#: dense bf16 tensor-core peaks (TFLOP/s, no sparsity) of the GPUs ``perf/mfu`` knows by name; the first
#: name found in ``torch.cuda.get_device_name()`` decides (``run.peak_tflops`` sets any other)
PEAK_TFLOPS = [("H100 PCIe", 756.0), ("H200", 989.4), ("H100", 989.4), ("A100", 312.0), ("L40S", 362.1)]


def peak_tflops(device: torch.device | str | None, configured: float | None = None) -> float | None:
    """The device's dense bf16 peak in TFLOP/s: ``configured``, else the table's for a known GPU, else None."""
    if configured is not None:
        return configured
    if device is None or torch.device(device).type != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for known, peak in PEAK_TFLOPS if known in name), None)


def _meta_like(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return torch.empty(value.shape, dtype=value.dtype, device="meta")
    if isinstance(value, (list, tuple)):
        return type(value)(_meta_like(v) for v in value)
    if isinstance(value, dict):
        return {k: _meta_like(v) for k, v in value.items()}
    return value


#: one forward's FLOPs by model (class, config, dtype) and input shapes, for every meter of the process (the
#: models of a run are rebuilt, and a process may train several runs): a meta forward takes a fraction of a second
_FORWARD_FLOPS: dict[tuple, float | None] = {}


def forward_flops(module: nn.Module, args: tuple = (), kwargs: dict | None = None) -> float | None:
    """FLOPs of one forward of ``module`` (a diffusers model, real or on the meta device) at the shapes of
    ``args`` / ``kwargs``, counted by ``torch.utils.flop_counter`` on a weightless copy built from its config on
    the meta device (no device time, no random draw); None when the meta device cannot run it."""
    try:
        with torch.random.fork_rng(devices=[]):  # counting must not move the run's random streams
            return _count_on_meta(module, args, kwargs or {})
    except Exception as err:  # noqa: BLE001 - any failure only means no FLOP count
        log.info("no FLOP count: the %s forward is not countable on the meta device (%s)",
                 type(module).__name__, str(err).splitlines()[0][:160] if str(err) else type(err).__name__)
        return None


def _count_on_meta(module: nn.Module, args: tuple, kwargs: dict) -> float:
    from torch.utils.flop_counter import FlopCounterMode

    with torch.device("meta"):
        meta = model_class(module).from_config(module.config)
    with diffusers_warnings_off():
        meta = meta.to(next(module.parameters()).dtype).eval()
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        meta(*_meta_like(args), **_meta_like(kwargs))
    return float(counter.get_total_flops())


#: input shapes a meter counts (a meta forward each, a fraction of a second for a large model); a family called
#: at ever new shapes (prompts of every length, unpadded) is left uncounted past them
MAX_SHAPES = 32


class FlopMeter:
    """Model FLOPs of the calls of ``models`` (a policy's transformers) since the last :meth:`take`.

    One forward's FLOPs at a call's input shapes are counted once per shape, by ``torch.utils.flop_counter``
    on a copy of the model built from its config on the meta device (no weights, no device time); a
    forward with gradients counts three times. A model whose forward the meta device cannot run (one that
    reads tensor values) makes the count unknown: :meth:`take` then returns None and nothing is logged.
    """

    def __init__(self, models: list[nn.Module]):
        self.flops = 0.0
        self.known = bool(models)
        self._per_call: dict[tuple, float | None] = {}
        self._models = {id(m): model_signature(m) for m in models}
        for model in models:
            model.register_forward_pre_hook(self._count, with_kwargs=True)

    def _count(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if not self.known:
            return
        key = (self._models.get(id(module)) or model_signature(module), input_signature(args), input_signature(kwargs))
        if key not in self._per_call:
            if len(self._per_call) >= MAX_SHAPES:
                log.info("perf/tflops_per_s not logged: the transformer is called at more than %d input shapes",
                         MAX_SHAPES)
                self.known = False
                return
            if key not in _FORWARD_FLOPS:
                _FORWARD_FLOPS[key] = forward_flops(module, args, kwargs)
                while len(_FORWARD_FLOPS) > 256:  # a long-lived process training many models keeps the newest
                    _FORWARD_FLOPS.pop(next(iter(_FORWARD_FLOPS)))
            self._per_call[key] = _FORWARD_FLOPS[key]
        flops = self._per_call[key]
        if flops is None:
            self.known = False
            return
        self.flops += flops * (3 if torch.is_grad_enabled() else 1)

    def take(self) -> float | None:
        """The FLOPs counted since the last call (None when unknown), and a fresh count."""
        flops, self.flops = self.flops, 0.0
        return flops if self.known else None


def policy_transformers(policy: Any) -> list[nn.Module]:
    """The diffusers transformers a policy calls (``transformer``, and ``transformer_2`` where a family has
    two experts), those with a config to rebuild them from."""
    components = getattr(getattr(policy, "pipe", None), "components", {}) or {}
    found = [m for name, m in components.items() if name.startswith("transformer") and isinstance(m, nn.Module)]
    return [m for m in found if hasattr(type(m), "from_config") and getattr(m, "config", None) is not None]
