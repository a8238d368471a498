"""The std of group advantages as DanceGRPO's and MixGRPO's scripts take it: torch's unbiased ``Tensor.std()``
with 1e-8 added, where Flow-GRPO's takes the population std with 1e-4."""

from __future__ import annotations

from typing import Any, Literal

from flowalign.config import Section

#: the advantage kinds whose normalisation is a group's (or the batch's) std; the others keep their own
STD_KINDS = ("group", "global_std", "per_reward")


class AdvantageStdOptions(Section):
    """Which std normalises the ``group`` / ``global_std`` / ``per_reward`` advantages."""

    #: the std of ``group`` / ``global_std`` / ``per_reward`` advantages: "unbiased" + 1e-8 (the authors'
    #: ``Tensor.std()``) or "population" + 1e-4 (Flow-GRPO's)
    advantage_std: Literal["unbiased", "population"] = "unbiased"


def advantage_std_options(tcfg: Any) -> dict[str, Any]:
    """The options of :func:`flowalign.advantages.compute_advantages` for ``tcfg.advantage_std`` (a trainer's
    ``advantage_options``): the unbiased std + 1e-8 where the kind normalises by a std, nothing otherwise."""
    unbiased = tcfg.advantage_std == "unbiased" and tcfg.advantage in STD_KINDS
    return {"unbiased": True, "eps": 1e-8} if unbiased else {}
