"""Every numeric knob has a lower and an upper bound: each field of every config section (every registered
trainer's ``Config`` included) and each numeric option of every command (those of pipelines/ and rewards/
included). A new unbounded ``int`` / ``float`` field or ``type=int`` option fails here; bound it (see
flowalign.limits and flowalign.cli.common.add_number) or list it below with the reason it needs no bound."""

from __future__ import annotations

import argparse
import importlib
import math
from types import UnionType
from typing import Annotated, Any, Union, get_args, get_origin

import pytest
from annotated_types import Ge, Gt, Le, Lt
from pydantic import BaseModel, Field
from pydantic.fields import FieldInfo

from flowalign.cli.common import Bounded
from flowalign.cli.main import build_parser
from flowalign.config import TrainConfig, load_config
from flowalign.errors import UserError
from flowalign.trainers import registered, trainer_config

#: ``"Model.field"`` of numeric config fields that need no bound, each with its reason (none today)
CONFIG_UNBOUNDED: dict[str, str] = {}

#: ``"command --flag"`` of numeric options that need no bound, each with its reason
CLI_UNBOUNDED: dict[str, str] = {}


def _bounded(metadata: list[Any]) -> tuple[bool, bool]:
    return (any(isinstance(m, (Ge, Gt)) for m in metadata), any(isinstance(m, (Le, Lt)) for m in metadata))


def unbounded_numbers(annotation: Any, metadata: list[Any]) -> list[str]:
    """What in ``annotation`` is a number without both bounds: the field itself (``metadata`` its
    constraints) or an element of a list / tuple / optional (bounded by ``Annotated[int, Field(...)]``)."""
    if annotation in (int, float):
        lo, hi = _bounded(metadata)
        return [] if lo and hi else [f"{annotation.__name__} without {'a lower' if not lo else 'an upper'} bound"]
    origin = get_origin(annotation)
    if origin is Annotated:
        base, *extra = get_args(annotation)
        inner = [m for e in extra for m in (e.metadata if isinstance(e, FieldInfo) else [e])]
        return unbounded_numbers(base, inner)
    if origin in (Union, UnionType):  # an optional number carries the field's own bounds
        return [p for a in get_args(annotation) if a is not type(None) for p in unbounded_numbers(a, metadata)]
    if origin in (list, tuple, set, frozenset):
        return [f"an element {p}" for a in get_args(annotation) if a is not Ellipsis for p in unbounded_numbers(a, [])]
    if origin is dict:  # free-form option mappings (reward options, model.defaults) are checked by validators
        return []
    return []


def nested_models(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for a in get_args(annotation) for m in nested_models(a)]


def config_problems(model: type[BaseModel], seen: set[type] | None = None) -> list[str]:
    """``Model.field: problem`` for every unbounded numeric field of ``model`` and the sections it holds."""
    seen = set() if seen is None else seen
    if model in seen:
        return []
    seen.add(model)
    problems = []
    for name, field in model.model_fields.items():
        where = f"{model.__name__}.{name}"
        if where not in CONFIG_UNBOUNDED:
            problems += [f"{where}: {p}" for p in unbounded_numbers(field.annotation, field.metadata)]
        for sub in nested_models(field.annotation):
            problems += config_problems(sub, seen)
    return problems


def trainer_configs() -> dict[str, type[BaseModel]]:
    found = {}
    for name, target in registered().items():
        module, _, attr = target.partition(":")
        found[name] = getattr(importlib.import_module(module), attr).Config
    return found


def test_every_config_field_has_both_bounds():
    problems = config_problems(TrainConfig)
    seen: set[type] = set()
    for config in trainer_configs().values():
        problems += config_problems(config, seen)
    assert not problems, "unbounded config fields:\n" + "\n".join(sorted(set(problems)))


def test_the_config_walk_finds_an_unbounded_field():
    """The walk above would see a field added without a bound, in a nested section or a list's elements."""
    class Inner(BaseModel):
        count: int = Field(1, ge=1)

    class Knobs(BaseModel):
        fine: float = Field(1.0, gt=0, le=2)
        inner: Inner = Inner()
        scales: list[float] = [1.0]
        maybe: int | None = None
        steps: list[Annotated[int, Field(ge=0, le=9)]] = []

    assert sorted(config_problems(Knobs)) == [
        "Inner.count: int without an upper bound",
        "Knobs.maybe: int without a lower bound",
        "Knobs.scales: an element float without a lower bound",
    ]


def parsers(parser: argparse.ArgumentParser, prefix: str = "") -> list[tuple[str, argparse.ArgumentParser]]:
    """``(command path, parser)`` of every sub-command, nested ones (``pretrain-tiny sd3``) included."""
    found = [(prefix, parser)] if prefix else []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found += parsers(sub, f"{prefix} {name}".strip())
    return found


def cli_problems(parser: argparse.ArgumentParser) -> list[str]:
    problems = []
    for command, p in parsers(parser):
        for action in p._actions:
            flag = f"{command.split()[0]} {(action.option_strings or [action.dest])[-1]}"
            if isinstance(action.type, Bounded):
                if not (math.isfinite(action.type.lo) and math.isfinite(action.type.hi)):
                    problems.append(f"{command} {action.option_strings}: an infinite bound")
            elif action.type in (int, float) and flag not in CLI_UNBOUNDED:
                problems.append(f"{command} {action.option_strings}: type={action.type.__name__} without bounds")
    return problems


def test_every_numeric_option_of_every_command_has_both_bounds():
    parser = build_parser()  # every command: the core's and those pipelines/ and rewards/ contribute
    commands = {c.split()[0] for c, _ in parsers(parser)}
    assert {"sample", "train", "pretrain-tiny", "serve-reward", "train-reward", "tiny"} <= commands
    problems = cli_problems(parser)
    assert not problems, "unbounded options:\n" + "\n".join(problems)


def test_the_option_walk_finds_an_unbounded_option():
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers().add_parser("grow")
    sub.add_subparsers().add_parser("deeper").add_argument("--size", type=int)
    assert cli_problems(parser) == ["grow deeper ['--size']: type=int without bounds"]


@pytest.mark.parametrize("overrides,needle", [
    (["trainer.updates_per_epoch=1000000000"], "trainer.updates_per_epoch: Input should be less than or equal to 1024"),
    (["trainer.inner_epochs=100000"], "trainer.inner_epochs: Input should be less than or equal to 1024"),
    (["model.lora.rank=100000"], "model.lora.rank: Input should be less than or equal to 8192"),
    (["trainer.name=awm", "trainer.train_timesteps=1000000"], "trainer.train_timesteps: Input should be less than or equal to 1000"),
    (["trainer.name=afd", "trainer.teacher={videos: v}", "trainer.train_timesteps=1000000"], "trainer.train_timesteps"),
    (["trainer.name=afd", "trainer.teacher={videos: v}", "trainer.disc_steps=1000000000"],
     "trainer.disc_steps: Input should be less than or equal to 1024"),
    (["trainer.name=afd", "trainer.teacher={videos: v}", "trainer.mirror_beta=1.0e30"],
     "trainer.mirror_beta: Input should be less than or equal to 1000000"),
    (["trainer.name=fav", "trainer.kde_temperatures=[-1]"], "trainer.kde_temperatures.0: Input should be greater than 0"),
    (["trainer.name=fav", "trainer.stein_temperatures=[0.5, 0]"], "trainer.stein_temperatures.1"),
    (["trainer.guidance_scale=1.0e30"], "trainer.guidance_scale: Input should be less than or equal to 100"),
    (["model.defaults={guidance_scale: 1.0e+30}"], "guidance_scale=1e+30: give a value in 0..100"),
    (["trainer.betas=[0.9, 1.5]"], "trainer.betas"),
    (["trainer.name=tempflow_grpo", "trainer.branch_steps=[1, 100000]"], "trainer.branch_steps.1"),
    (["rewards=[{name: vvr, weight: 1.0e30}]"], "rewards.0.weight: Input should be less than or equal to 1000000"),
    (["parallel.timeout_s=1.0e30"], "parallel.timeout_s"),
])
def test_out_of_bound_values_are_refused_in_one_line(overrides, needle):
    with pytest.raises(UserError) as err:
        cfg = load_config(None, overrides)
        trainer_config(cfg.trainer)
    message = str(err.value)
    assert needle in message and "\n" not in message


def test_values_at_the_bounds_are_accepted():
    cfg = load_config(None, ["trainer.updates_per_epoch=1024", "model.lora.rank=8192", "trainer.guidance_scale=100",
                             "trainer.betas=[0, 0.999]"])
    _, tcfg = trainer_config(cfg.trainer)
    assert (tcfg.updates_per_epoch, cfg.model.lora.rank, tcfg.guidance_scale) == (1024, 8192, 100)
