"""The frozen networks a trainer places on the device besides the policy and the rewards, as it declares them.

A trainer lists them in :meth:`flowalign.trainers.base.GroupTrainer.frozen_encoders` (GARDO's diversity
encoder); the trainer loads what the list names, and ``flowalign plan`` sizes each entry through its ``encoders``
plugin (:func:`flowalign.plugins.planned_encoder_bytes`) and counts it with the frozen reward models, so what is
planned is what is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch

#: the dtype names a config gives an encoder, as torch dtypes
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class FrozenEncoder:
    """An image encoder of the ``encoders`` plugin table, held frozen on the policy's device.

    ``setting``: the config section that names it (``trainer.diversity_encoder``), which errors and the plan
    name; ``name``, ``path``, ``dtype`` and ``options``: what the encoder is built with
    (:func:`flowalign.plugins.load_encoder`)."""

    setting: str
    name: str
    path: str | None
    dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]
