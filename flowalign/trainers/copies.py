"""The extra copies of weights a trainer holds besides the policy, as it declares them.

A trainer lists them in :meth:`flowalign.trainers.base.GroupTrainer.weight_copies`; the loop reads the
list to keep a full fine-tune's frozen reference (and where: device or CPU memory), and ``flowalign plan``
reads the same list to count their memory, so what is planned is what is allocated.

A copy of the trained tensors other than the loop's reference (a snapshot, behaviour weights, a teacher
adapter) is run the only way the one policy can run other trained tensors: copied into the live
parameters by :func:`flowalign.weight_swap.swapped_in`, which keeps the live values meanwhile, one more
device copy of the trained tensors, wherever the copy itself lives (:func:`swaps_in`). The reference is
not: its passes run the frozen modules in the trained ones' place (``policy.adapter_disabled()``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class WeightCopy:
    """``count`` copies of one kind of weights.

    ``kind``: what the copy is for (``reference``: the frozen starting weights a full fine-tune's reference
    passes run, kept by the loop; ``snapshot``: an earlier state of the trained weights; ``teacher``;
    ``critic``; ``behaviour``: the weights the rollouts are sampled with; ``reward``: a reward model the
    trainer holds, e.g. a latent reward with its own frozen transformer). ``size``: ``trained`` is the
    size of the trained tensors (the adapter under LoRA, the transformer under full fine-tuning), ``model``
    the whole transformer, ``own`` a network of the trainer's own of ``params`` parameters (trained in
    float32 with Adam: weights, gradients and two moments). ``offloaded``: held in CPU memory (moved to the
    device only for its passes, if at all).
    """

    kind: Literal["reference", "snapshot", "teacher", "critic", "behaviour", "reward"]
    size: Literal["trained", "model", "own"] = "trained"
    count: int = 1
    offloaded: bool = False
    params: int = 0


def device_copies(copies: list[WeightCopy], size: str) -> int:
    """How many copies of ``size`` the device holds."""
    return sum(c.count for c in copies if c.size == size and not c.offloaded)


def device_own_params(copies: list[WeightCopy]) -> int:
    """Parameters of the trainer's own networks on the device."""
    return sum(c.count * c.params for c in copies if c.size == "own" and not c.offloaded)


def swaps_in(copies: list[WeightCopy]) -> bool:
    """Whether the trainer runs passes with a copy of the trained tensors swapped into the live parameters
    (every ``trained`` copy but the reference), holding a device copy of the live ones during them."""
    return any(c.size == "trained" and c.kind != "reference" and c.count > 0 for c in copies)


def keeps_reference(copies: list[WeightCopy]) -> WeightCopy | None:
    """The frozen reference copy among ``copies`` (the loop keeps it), or None."""
    return next((c for c in copies if c.kind == "reference"), None)


def full_reference(tcfg: object) -> list[WeightCopy]:
    """The frozen reference copy a full fine-tune's reference passes run (``trainer.reference_offload``:
    in CPU memory)."""
    return [WeightCopy("reference", "trained", offloaded=bool(getattr(tcfg, "reference_offload", False)))]
