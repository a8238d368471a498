"""What every DiT family of latent registers shares: the hook's view of a block's inputs, and the defaults
of a family (no options of its own)."""

from __future__ import annotations

from typing import Any

from torch import nn


def block_inputs(names: tuple[str, ...], args: tuple, kwargs: dict) -> tuple[Any, ...]:
    """The block's inputs ``names`` in that order, however it was called (absent ones are None)."""
    bound = dict(zip(names, args))
    bound.update({k: kwargs[k] for k in names if k in kwargs})
    return tuple(bound.get(n) for n in names)


class RegisterFamily:
    """How registers pass one DiT family: ``blocks()``, ``advance(block, reg, args, kwargs)`` and
    ``velocity(x, σ, cond)`` come from the subclass; options default to none."""

    name = ""

    def __init__(self, transformer: nn.Module, options: dict[str, Any]):
        self.transformer = transformer

    @staticmethod
    def options_from_policy(policy: Any) -> dict[str, Any]:
        """Options that make the reward score latents as ``policy`` samples them."""
        return {}

    def options(self) -> dict[str, Any]:
        """This family's options, as saved in the reward folder's config."""
        return {}
