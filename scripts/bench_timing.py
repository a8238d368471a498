"""Timing for ``scripts/bench.py train``: the intervals in which model or reward work ran, and the
plug-in rewards both sides of the bench score with (importable as ``scripts.bench_timing:redness``, so
flowalign's reward registry loads the same functions the bare loop calls)."""

from __future__ import annotations

import threading
import time

import torch


class Intervals:
    """Wall-clock intervals in which "model or reward" work ran (any thread); ``busy`` is their union."""

    def __init__(self):
        self.spans: list[tuple[float, float]] = []
        self.lock = threading.Lock()
        self.starts = threading.local()
        #: the timestep tensors of the forwards run under grad, kept on their device: reading them back at each
        #: forward would make the host wait for the GPU there, a wait neither side's own loop has
        self.grad_timesteps: list[torch.Tensor] = []

    def add(self, t0: float, t1: float) -> None:
        with self.lock:
            self.spans.append((t0, t1))

    def wrap(self, fn):
        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.add(t0, time.perf_counter())

        return timed

    def hook(self, module: torch.nn.Module, count_trained: bool = False) -> None:
        """Time every forward of ``module``; with ``count_trained``, note the timesteps run under grad."""

        def pre(mod, args, kwargs):
            self.starts.__dict__.setdefault("stack", []).append(time.perf_counter())
            if count_trained and torch.is_grad_enabled() and "timestep" in kwargs:
                self.grad_timesteps.append(kwargs["timestep"].detach().flatten())

        def post(mod, args, kwargs, out):
            self.add(self.starts.stack.pop(), time.perf_counter())

        module.register_forward_pre_hook(pre, with_kwargs=True)
        module.register_forward_hook(post, with_kwargs=True)

    def trained_timesteps(self) -> int:
        """How many distinct timesteps ran under grad since the list was last cleared (read back once, here)."""
        if not self.grad_timesteps:
            return 0
        return len(set(torch.cat([t.float().cpu() for t in self.grad_timesteps]).tolist()))

    def busy(self, t0: float, t1: float) -> float:
        with self.lock:
            spans = sorted((max(a, t0), min(b, t1)) for a, b in self.spans if b > t0 and a < t1)
        total, end = 0.0, t0
        for a, b in spans:
            if b > end:
                total += b - max(a, end)
                end = b
        return total


SPANS = Intervals()
SLOW_REWARD_SECONDS = 0.5


def redness(samples: torch.Tensor, prompts, metadata) -> torch.Tensor:
    """Mean red minus mean green/blue ``(B,)``: a cheap pixel reward (timed as reward work)."""
    t0 = time.perf_counter()
    out = samples[:, 0].flatten(1).mean(1) - samples[:, 1:].flatten(1).mean(1)
    SPANS.add(t0, time.perf_counter())
    return out


def slow_redness(samples: torch.Tensor, prompts, metadata) -> torch.Tensor:
    """:func:`redness` after a 0.5 s sleep per call: a remote judge's latency."""
    t0 = time.perf_counter()
    time.sleep(SLOW_REWARD_SECONDS)
    SPANS.add(t0, time.perf_counter())
    return redness(samples, prompts, metadata)


def instrument(pipe, transformer: torch.nn.Module) -> None:
    """Time the transformer and text encoders (forward hooks) and the VAE decode of one pipeline."""
    SPANS.hook(transformer, count_trained=True)
    for name in ("text_encoder", "text_encoder_2", "text_encoder_3"):
        SPANS.hook(getattr(pipe, name))
    pipe.vae.decode = SPANS.wrap(pipe.vae.decode)
