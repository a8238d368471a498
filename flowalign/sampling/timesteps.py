"""The timestep a policy's transformer reads, changed for a block of code, and the authors' σ grids that
differ from a model's own (``docs/methods/samplers.md``).

flowalign's pipelines hand the transformer ``timestep = 1000·σ`` (float32; FLUX's reads σ and scales it
inside). Some authors' pipelines cast it to an integer (``torch.long``), i.e. ``trunc(1000·σ)``, and hand a
σ-reading transformer that integer over 1000; :func:`model_timestep` reproduces such a form exactly by
rewriting the ``timestep`` the transformer is called with, whatever pipeline made it.
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from flowalign.errors import UserError

#: ``timestep (B,) -> timestep (B,)``: what the transformer reads instead
TimestepMap = Callable[[torch.Tensor], torch.Tensor]


def truncated(timestep: torch.Tensor) -> torch.Tensor:
    """``trunc(t)``: the integer timestep of a pipeline that casts ``1000·σ`` (float32) to ``torch.long``."""
    return torch.trunc(timestep)


def fixed(value: float) -> TimestepMap:
    """Every row reads ``value`` (e.g. ``int(1000·σ)`` computed in double precision from a Python float)."""
    return lambda timestep: torch.full_like(timestep, float(value))


def time_shift(u: torch.Tensor, shift: float) -> torch.Tensor:
    """``shift·u / (1 + (shift − 1)·u)`` elementwise, in ``u``'s dtype (DanceGRPO's ``sd3_time_shift``)."""
    return (shift * u) / (1 + (shift - 1) * u)


def shifted_grid(num_steps: int, shift: float) -> torch.Tensor:
    """``(num_steps + 1,)`` float32 σ grid, 1 → 0: ``u = linspace(1, 0, T + 1)`` time-shifted to
    ``shift·u / (1 + (shift − 1)·u)``, in float32 as DanceGRPO's ``sd3_time_shift(shift, linspace(1, 0, T + 1))``."""
    return time_shift(torch.linspace(1, 0, num_steps + 1), shift)


@dataclass(frozen=True)
class ShiftedGrid:
    """A rollout's σ grid as :func:`shifted_grid` (compared by value, so groups sampled alike batch together)."""

    shift: float

    def __call__(self, num_steps: int) -> torch.Tensor:
        return shifted_grid(num_steps, self.shift)


def integer_timestep(sigma: float) -> int:
    """``int(1000·σ)`` with σ a Python float (double precision), as ``torch.full(..., σ*1000, dtype=long)``."""
    return int(float(sigma) * 1000)


#: the scale each transformer reads its timestep at (1000: ``1000·σ``, 1: σ, -1: ``1 − σ``, Z-Image's), learnt at its
#: first call under a form: reading the timestep back is a host wait on a GPU, once per transformer rather than once
#: per call
_SCALES: weakref.WeakKeyDictionary[torch.nn.Module, float] = weakref.WeakKeyDictionary()


#: how a refused timestep form is left: the trainers' option
CONTINUOUS = "use the continuous timestep form (trainer.model_timestep: continuous)"


def _timestep_scale(policy: Any, t: torch.Tensor, sigma: float) -> float:
    """1000 when the transformer is handed ``1000·σ``, 1 when σ, -1 when ``1 − σ`` (Z-Image's time); else one line
    refusing the form."""
    if torch.allclose(t.float(), torch.full_like(t.float(), 1000.0 * sigma), atol=0.5):
        return 1000.0
    if torch.allclose(t.float(), torch.full_like(t.float(), sigma), atol=5e-4):
        return 1.0
    if torch.allclose(t.float(), torch.full_like(t.float(), 1.0 - sigma), atol=5e-4):
        return -1.0
    raise UserError(f"{getattr(policy, 'family', type(policy).__name__)}'s transformer reads timestep "
                    f"{t.flatten()[0].item():.6g} at sigma {sigma:.6g}, neither 1000*sigma, sigma nor 1 - sigma: an "
                    f"integer timestep form does not apply to it; {CONTINUOUS}")


@contextmanager
def model_timestep(policy: Any, form: TimestepMap | None, sigma: float | None = None) -> Iterator[None]:
    """Within the block, ``policy.transformer`` reads ``form(timestep)`` in place of the pipeline's timestep
    (``form`` None: unchanged). The transformer must take ``timestep`` as a keyword, as diffusers' do.

    Given the ``sigma`` of the calls, a transformer that reads σ itself (FLUX scales it by 1000 inside) reads
    ``form(1000·t) / 1000``, as DanceGRPO's FLUX script feeds it its integer timesteps over 1000; one that reads
    ``1 − σ`` (Z-Image's ``t``, its keyword) reads ``1 − form(1000·(1 − t)) / 1000``, as Pref-GRPO's Z-Image script;
    one that reads none of these is refused rather than fed a wrong timestep."""
    if form is None:
        yield
        return
    transformer = getattr(policy, "transformer", None)
    if not isinstance(transformer, torch.nn.Module):
        raise UserError(f"{getattr(policy, 'family', type(policy).__name__)} has no transformer module whose "
                        f"timestep can be set: {CONTINUOUS}")

    def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        key = "timestep" if "timestep" in kwargs else "t" if "t" in kwargs else None
        if key is None:
            raise UserError(f"{type(module).__name__} is called without a timestep keyword: its timestep form "
                            f"cannot be set; {CONTINUOUS}")
        t = kwargs[key]
        scale = _SCALES.get(module)
        if scale is None and sigma is not None:
            scale = _timestep_scale(policy, t, float(sigma))
            if sigma >= 1e-3:  # below, 1000·σ and σ cannot be told apart
                _SCALES[module] = scale
        if scale == 1.0:  # a σ-reading transformer
            return args, dict(kwargs, **{key: (form(t * 1000) / 1000).to(t.dtype)})
        if scale == -1.0:  # a (1 − σ)-reading transformer
            return args, dict(kwargs, **{key: (1 - form((1 - t) * 1000) / 1000).to(t.dtype)})
        return args, dict(kwargs, **{key: form(t).to(t.dtype)})

    handle = transformer.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()
