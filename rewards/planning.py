"""How a reward states its size for ``flowalign plan`` (:class:`flowalign.protocols.SizedReward`) without reading
its weights: its models built from their configs on the meta device (shapes, no memory, no initialisation) and
counted in the dtype its options give, where its ``device`` option puts them.

Where a reward's folder does not exist (the shipped recipes name placeholders such as ``/path/to/PickScore_v1``),
the model it is made for stands in from ``assets/reward_architectures/<name>/``: the published configs of the
released reward models, no weights (the folder's README says where each comes from). A reward made for no single
model (any CLIP, any VLM) raises :class:`~flowalign.protocols.NotSized` instead, naming the missing option.
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from flowalign.paths import REPO_ROOT
from flowalign.protocols import NotSized

#: the published configs of the released reward models (no weights), one folder each
REWARD_ARCHITECTURES = REPO_ROOT / "assets" / "reward_architectures"


def on_accelerator(device: Any) -> bool:
    """Whether a reward's ``device`` option leaves its models on the run's accelerator: None (the samples'
    device, which in a run is the GPU) or any device but the CPU."""
    if device is None:
        return True
    try:
        return torch.device(device).type != "cpu"
    except (RuntimeError, TypeError):  # the reward refuses it when built; the plan errs high meanwhile
        return True


def module_bytes(modules: Iterable[nn.Module]) -> int:
    """Bytes of the parameters and buffers of ``modules`` as they are (each tensor once: tied weights, or one
    module reachable from two, count once)."""
    seen: set[int] = set()
    total = 0
    for module in modules:
        for t in itertools.chain(module.parameters(), module.buffers()):
            if id(t) not in seen:
                seen.add(id(t))
                total += t.nelement() * t.element_size()
    return total


def on_meta(build: Callable[[], nn.Module]) -> nn.Module:
    """``build()`` with every tensor it makes on the meta device."""
    with torch.device("meta"):
        return build()


def existing(path: str | Path | None) -> Path | None:
    """``path`` as a :class:`Path` where it exists, else None."""
    if path is None or not str(path).strip():
        return None
    p = Path(path).expanduser()
    return p if p.exists() else None


def published(name: str) -> Path:
    """The folder of the published architecture ``name`` under :data:`REWARD_ARCHITECTURES`."""
    folder = REWARD_ARCHITECTURES / name
    if not folder.is_dir():  # a packaging slip, not a user's: say which file is missing
        raise NotSized(f"its published architecture {name} is missing from {REWARD_ARCHITECTURES}")
    return folder


def missing(option: str, value: Any) -> NotSized:
    """The reason a reward cannot be sized: ``option`` unset or naming nothing, and no architecture to stand in."""
    if value is None or not str(value).strip():
        return NotSized(f"{option} is not set")
    return NotSized(f"{option}={value} does not exist, and no published architecture stands in for it")


def transformers_bytes(folder: Path, model_class: Any, dtype: torch.dtype) -> int:
    """Bytes of the transformers ``model_class`` built from ``folder``'s ``config.json`` on the meta device, cast to
    ``dtype`` as the rewards cast what they load."""
    config = model_class.config_class.from_pretrained(folder)
    return module_bytes([on_meta(lambda: model_class(config)).to(dtype)])


def holds_nothing(options: dict[str, Any]) -> int:
    """``planned_bytes`` of a reward that loads no model (a program, a measurement, a remote judge): nothing
    on the device."""
    return 0


def option(reward: type, options: dict[str, Any], name: str) -> Any:
    """``options[name]``, else the default its constructor gives it (the first class of ``reward``'s bases
    whose ``__init__`` names it), so a size is planned with the settings the reward would be built with."""
    if name in options:
        return options[name]
    for cls in reward.__mro__:
        init = cls.__dict__.get("__init__")
        param = inspect.signature(init).parameters.get(name) if init is not None else None
        if param is not None and param.default is not inspect.Parameter.empty:
            return param.default
    return None
