"""Run with another set of weights in the live parameters (EMA, a behaviour policy, a frozen reference)."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Sequence

import torch


@contextmanager
def swapped_in(params: Sequence[torch.nn.Parameter], tensors: Sequence[torch.Tensor]) -> Iterator[None]:
    """Inside, ``params`` hold ``tensors``; the live values are restored after, even on error.

    One in-place copy each way, so the model, its hooks and its optimiser keep their parameter objects.
    """
    live = [p.detach().clone() for p in params]
    with torch.no_grad():
        for p, t in zip(params, tensors):
            p.copy_(t)
    try:
        yield
    finally:
        with torch.no_grad():
            for p, v in zip(params, live):
                p.copy_(v)
