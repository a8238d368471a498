"""A training step's memory and throughput for its log line: ``memory/peak_gib_allocated`` and
``memory/peak_gib_reserved`` (the CUDA allocator's peaks over the step, GiB; none on a CPU),
``perf/samples_per_s`` (samples generated per second of the step), ``perf/tflops_per_s`` (the transformer's
model FLOPs over the step's seconds, :mod:`flowalign.flop_meter`) and ``perf/mfu`` (that over the device's
peak).
"""

from __future__ import annotations

from typing import Any

import torch

GIB = 2**30


def _cuda(device: torch.device | str | None) -> bool:
    return device is not None and torch.device(device).type == "cuda" and torch.cuda.is_available()


def begin_step(device: torch.device | str | None) -> None:
    """Start the step's peak-memory window (the allocator's peaks since the last reset)."""
    if _cuda(device):
        torch.cuda.reset_peak_memory_stats(device)


def generated_samples(batch: Any) -> int | None:
    """Samples a step's batch rolled out: the loop's group batch (``groups``, one id per sample), also when
    a trainer's batch holds one as its ``trunk``; None for batches of another kind (pairs, distillation
    targets), whose step logs no throughput."""
    from flowalign.trainers.rollouts import StepBatch

    for candidate in (batch, getattr(batch, "trunk", None)):
        if isinstance(candidate, StepBatch) and isinstance(candidate.groups, torch.Tensor):
            return int(candidate.groups.numel())
    return None


def step_logs(device: torch.device | str | None, seconds: float, samples: int | None, flops: float | None = None,
              peak: float | None = None) -> dict[str, float]:
    """The step's memory peaks (CUDA only) and throughput, for its log line: ``flops`` the step's model FLOPs
    (:class:`flowalign.flop_meter.FlopMeter`), ``peak`` the device's TFLOP/s
    (:func:`flowalign.flop_meter.peak_tflops`)."""
    logs: dict[str, float] = {}
    if _cuda(device):
        logs["memory/peak_gib_allocated"] = torch.cuda.max_memory_allocated(device) / GIB
        logs["memory/peak_gib_reserved"] = torch.cuda.max_memory_reserved(device) / GIB
    if samples and seconds > 0:
        logs["perf/samples_per_s"] = samples / seconds
    if flops and seconds > 0:
        logs["perf/tflops_per_s"] = flops / seconds / 1e12
        if peak:
            logs["perf/mfu"] = logs["perf/tflops_per_s"] / peak
    return logs
