"""The frozen models a run places on each rank's device besides the policy, for ``flowalign plan``.

Every rank builds the run's rewards (``rewards``), its held-out panel (``eval.rewards``) and the evaluation
benchmark's own reward (``eval.bench``, where no ``eval.prompts`` replace it), each a model of its own even where
two name the same one, and a model-backed reward moves its networks to the samples' device, the rank's GPU,
unless its ``device`` option says otherwise. A trainer adds its own frozen encoders
(:meth:`flowalign.trainers.base.GroupTrainer.frozen_encoders`: GARDO's diversity encoder). None of them is
sharded or trained: each is whole on every rank, in the dtype it runs in.

Each states its size itself, without loading anything: a reward through the registry
(:func:`flowalign.plugins.planned_reward_bytes`, :class:`flowalign.protocols.SizedReward`), an encoder through its
plugin (:func:`flowalign.plugins.planned_encoder_bytes`). One that cannot (a plug-in that does not say, a folder
that does not exist and no published architecture to stand in for it) is listed as not counted, with why,
never counted as 0.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable

from flowalign.config import TrainConfig
from flowalign.errors import UserError
from flowalign.protocols import NotSized


@dataclass
class FrozenModels:
    """Bytes on one rank's device of each frozen model a run loads (by label, in the config's order), and the
    ones that could not be sized, each with why."""

    counted: dict[str, int] = field(default_factory=dict)
    not_counted: dict[str, str] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.counted.values())


#: what a reward's or an encoder's sizing gave (bytes, or the reason it gave none), by what it was asked: a
#: plan sizes each strategy and each candidate fix with the same rewards
_SIZES: dict[str, int | str] = {}


def _sized(key: Any, size: Callable[[], int]) -> int | str:
    text = json.dumps(key, sort_keys=True, default=str)
    if text not in _SIZES:
        try:
            _SIZES[text] = int(size())
        except NotSized as err:
            _SIZES[text] = str(err)
        except (UserError, OSError, ValueError, KeyError) as err:  # an option or a config.json it cannot read
            _SIZES[text] = (str(err).strip().splitlines() or [type(err).__name__])[0]
        while len(_SIZES) > 256:  # a long-lived process planning many configs keeps the newest
            _SIZES.pop(next(iter(_SIZES)))
    return _SIZES[text]


def _benchmark_reward(cfg: TrainConfig) -> tuple[str, dict[str, Any]] | None:
    """The evaluation benchmark's reward and its options, where the run evaluates on one that names it."""
    from flowalign.benchmarks import benchmark_reward

    if not cfg.eval.bench or cfg.eval.prompts:
        return None
    return benchmark_reward(cfg.eval.bench, cfg.eval.reward_options)


def frozen_models(cfg: TrainConfig) -> FrozenModels:
    """The frozen models of ``cfg`` on each rank's device (see the module docstring)."""
    from flowalign.plugins import planned_encoder_bytes, planned_reward_bytes
    from flowalign.trainers import trainer_config

    entries: list[tuple[str, Any, Callable[[], int]]] = []
    for spec in cfg.rewards:
        options = spec.options
        entries.append((spec.key, ("reward", spec.name, options),
                        lambda n=spec.name, o=options: planned_reward_bytes(n, o)))
    for spec in cfg.eval.rewards:
        options = spec.options
        entries.append((f"eval.rewards {spec.key}", ("reward", spec.name, options),
                        lambda n=spec.name, o=options: planned_reward_bytes(n, o)))
    bench = _benchmark_reward(cfg)
    if bench is not None:
        name, options = bench
        label = f"eval.bench {cfg.eval.bench}" + (f" ({name})" if name != cfg.eval.bench else "")
        entries.append((label, ("reward", name, options),
                        lambda: planned_reward_bytes(name, options)))
    trainer, tcfg = trainer_config(cfg.trainer)
    for e in trainer.frozen_encoders(tcfg):
        entries.append((f"{e.setting} {e.name}", ("encoder", e.name, e.path, e.dtype, e.options),
                        lambda e=e: planned_encoder_bytes(e.name, e.path, dtype=e.torch_dtype, **e.options)))
    out = FrozenModels()
    for label, key, size in entries:
        unique, n = label, 2
        while unique in out.counted or unique in out.not_counted:  # one reward named twice: two models
            unique, n = f"{label} #{n}", n + 1
        got = _sized(key, size)
        if isinstance(got, int):
            out.counted[unique] = got
        else:
            out.not_counted[unique] = got
    return out
