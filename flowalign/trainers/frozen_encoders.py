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

from flowalign.errors import UserError

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


def check_encoder_setting(setting: str, name: str, path: str | None, chosen_by: str, example: str,
                          instead: str) -> None:
    """Refuse, in one line naming ``setting``, an encoder the ``encoders`` plugin table lacks, or one without a
    local folder; ``chosen_by``: the option that asked for the encoder (``trainer.feature=encoder``), ``example``:
    a folder to name, ``instead``: the setting that needs none."""
    from flowalign.plugins import targets  # lazily: the plugin table is read only when an encoder is asked for

    known = targets("encoders")
    if name not in known:
        raise UserError(f"{setting}.name={name!r} is not a known image encoder (known: {', '.join(sorted(known))})")
    if not path:
        raise UserError(f"{chosen_by}: {setting}.path is not set; give the encoder's local model folder ({example}), "
                        f"or set {instead}")
