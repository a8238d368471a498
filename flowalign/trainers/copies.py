"""The extra copies of weights a trainer holds besides the policy, as it declares them.

A trainer lists them in :meth:`flowalign.trainers.base.GroupTrainer.weight_copies`; the loop reads the
list to keep a full fine-tune's frozen reference (and where: device or CPU memory), and ``flowalign plan``
reads the same list to count their memory, so what is planned is what is allocated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class WeightCopy:
    """``count`` copies of one kind of weights.

    ``kind``: what the copy is for (``reference``: the frozen starting weights a full fine-tune's reference
    passes run, kept by the loop; ``snapshot``: an earlier state of the trained weights; ``teacher``;
    ``critic``; ``behaviour``: the weights the rollouts are sampled with). ``size``: ``trained`` is the
    size of the trained tensors (the adapter under LoRA, the transformer under full fine-tuning), ``model``
    the whole transformer. ``offloaded``: held in CPU memory, moved to the device only for its passes.
    """

    kind: Literal["reference", "snapshot", "teacher", "critic", "behaviour"]
    size: Literal["trained", "model"] = "trained"
    count: int = 1
    offloaded: bool = False


def device_copies(copies: list[WeightCopy], size: str) -> int:
    """How many copies of ``size`` the device holds."""
    return sum(c.count for c in copies if c.size == size and not c.offloaded)


def keeps_reference(copies: list[WeightCopy]) -> WeightCopy | None:
    """The frozen reference copy among ``copies`` (the loop keeps it), or None."""
    return next((c for c in copies if c.kind == "reference"), None)


def full_reference(tcfg: object) -> list[WeightCopy]:
    """The frozen reference copy a full fine-tune's reference passes run (``trainer.reference_offload``:
    in CPU memory)."""
    return [WeightCopy("reference", "trained", offloaded=bool(getattr(tcfg, "reference_offload", False)))]
