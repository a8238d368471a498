"""Reward registry: rewards are found by name, by ``package.module:attr`` or by entry point.

>>> @register("sharpness")
... def sharpness(samples, prompts, metadata): ...
>>> reward = load("sharpness")

A registered class is instantiated with the keyword options given to :func:`load`; a registered
function is wrapped so that it returns a :class:`flowalign.protocols.RewardOutput`. :func:`planned_bytes`
asks a reward what it would hold on the device without building it (``flowalign plan``).

A reward class whose option changed its default states what runs saved without that option computed:
``before = {option: former value}``, and ``before_when = {option: (other option, its values)}`` where the
former value differed only under those values (:func:`former_forms`; a run's ``config.yaml`` records such
options, and a run saved before is resumed only as it was).
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any, Callable

from flowalign.errors import UserError
from flowalign.yaml_numbers import numeric_annotation

if TYPE_CHECKING:
    import torch

    from flowalign.protocols import RewardOutput

ENTRY_POINT_GROUP = "flowalign.rewards"
_REGISTRY: dict[str, Callable[..., Any]] = {}
# modules of this package that register built-in rewards when imported
_BUILTIN_MODULES = (
    "rewards.vvr",
    "rewards.clip_score",
    "rewards.aesthetic",
    "rewards.preference",
    "rewards.image_similarity",
    "rewards.imagereward",
    "rewards.lpips_reward",
    "rewards.classic",
    "rewards.video",
    "rewards.vvr_motion",
    "rewards.motion_insight",
    "rewards.vvr_edit",
    "rewards.vlm_judge",
    "rewards.remote",
    "rewards.geneval",
    "rewards.hpsv3",
    "rewards.unified_reward",
    "rewards.videoalign",
    "rewards.ocr",
    "rewards.compass",
)


def register(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: register a reward class or function under ``name``."""

    def wrap(obj: Callable[..., Any]) -> Callable[..., Any]:
        if name in _REGISTRY and _REGISTRY[name] is not obj:
            raise ValueError(f"a reward named {name!r} is already registered ({_REGISTRY[name]!r})")
        _REGISTRY[name] = obj
        return obj

    return wrap


class FunctionReward:
    """Adapts a plain ``fn(samples, prompts, metadata) -> (B,) tensor | RewardOutput`` to the protocol."""

    differentiable = False

    def __init__(self, name: str, fn: Callable[..., Any], **options: Any):
        self.name, self.fn, self.options = name, fn, options

    def __call__(self, samples: torch.Tensor, prompts: list[str], metadata: list[dict]) -> RewardOutput:
        # torch on use: importing the registry (``import rewards``, the CLI's --help) stays light
        import torch

        from flowalign.protocols import RewardOutput

        out = self.fn(samples, prompts, metadata, **self.options)
        if isinstance(out, RewardOutput):
            return out
        score = torch.as_tensor(out, dtype=torch.float32).flatten()
        return RewardOutput({self.name: score}, valid=torch.isfinite(score))


def _import_builtins() -> None:
    for module in _BUILTIN_MODULES:
        importlib.import_module(module)


def available() -> list[str]:
    """Names of the registered rewards (built-in and entry-point ones)."""
    _import_builtins()
    names = set(_REGISTRY) | {ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)}
    return sorted(names)


def differentiable() -> list[str]:
    """Names of the registered rewards whose scores pass gradients to the samples (``differentiable = True``)."""
    _import_builtins()
    return sorted(n for n, obj in _REGISTRY.items() if getattr(obj, "differentiable", False) is True)


def _resolve(spec: str) -> tuple[str, Callable[..., Any]]:
    if ":" in spec:
        module_name, _, attr = spec.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as e:
            raise UserError(f"reward {spec!r}: cannot import module {module_name!r} ({e}); check the spelling and that it is installed") from e
        if not hasattr(module, attr):
            raise UserError(f"reward {spec!r}: module {module_name!r} has no attribute {attr!r}")
        return attr, getattr(module, attr)
    _import_builtins()
    if spec in _REGISTRY:
        return spec, _REGISTRY[spec]
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name == spec:
            return spec, ep.load()
    raise UserError(f"unknown reward {spec!r}; available: {', '.join(available())} (or give 'package.module:attr')")


def load(spec: str, **options: Any) -> Any:
    """Instantiate the reward named ``spec`` with ``options`` (a class is called, a function wrapped)."""
    name, obj = _resolve(spec)
    _check_options(spec, obj, options)
    if isinstance(obj, type):
        try:
            return obj(**options)
        except TypeError as e:  # options passed on through **kwargs to a base class
            if "unexpected keyword argument" not in str(e):
                raise
            raise UserError(f"reward {spec!r} does not take that option ({e}); check the reward's options") from None
    return FunctionReward(name, obj, **options)


def check(spec: str, **options: Any) -> None:
    """Refuse (``UserError``) an unknown reward or an option it does not take, without building it (no weights
    are read): what ``flowalign train --check`` and ``flowalign plan`` ask of every reward of a config."""
    _check_options(spec, _resolve(spec)[1], options)


def planned_bytes(spec: str, options: dict[str, Any]) -> int:
    """Bytes the reward ``spec`` built with ``options`` holds on the device of one process, as it states them
    without loading anything (its ``planned_bytes``: :class:`flowalign.protocols.SizedReward`). Raises
    :class:`flowalign.protocols.NotSized` where it cannot say: a reward without ``planned_bytes`` (a plug-in
    function or class that does not state its size), or one whose own sizing names what is missing."""
    from flowalign.protocols import NotSized

    _, obj = _resolve(spec)
    sized = getattr(obj, "planned_bytes", None)
    if not callable(sized):
        raise NotSized("it does not state its size: give its class a planned_bytes(options) classmethod")
    return int(sized(dict(options)))


def former_forms(spec: str) -> tuple[dict[str, Any], dict[str, tuple[str, tuple[Any, ...]]], dict[str, Any]]:
    """``(before, before_when, defaults)`` of the reward ``spec``: its class's ``before`` (``{option: what runs
    saved without it computed}``), ``before_when`` (``{option: (other option, values)}``: the former value
    computed something else only where the other option had one of those values), and the current default of
    each option they name. A reward may answer for itself with a ``former_forms()`` classmethod (a video twin
    takes its image reward's options). All empty for a reward that declares none, a name the registry does
    not know and a plug-in path (``pkg.module:attr``), whose options stay as written."""
    import inspect

    if ":" in spec:
        return {}, {}, {}
    try:
        _, obj = _resolve(spec)
    except UserError:  # unknown here: the run's own checks name it
        return {}, {}, {}
    own = getattr(obj, "former_forms", None)
    if callable(own):
        return own()
    before, when = getattr(obj, "before", None), getattr(obj, "before_when", None) or {}
    if not isinstance(before, dict) or not before:
        return {}, {}, {}
    params = inspect.signature(obj).parameters
    defaults = {}
    for name in dict.fromkeys([*before, *(option for option, _ in when.values())]):
        param = params.get(name)
        value = None if param is None or param.default is param.empty else param.default
        # a None default standing for the class's own (CLIPScore's resize: default_resize, "pad" for hps)
        defaults[name] = getattr(obj, f"default_{name}", None) if value is None else value
    return dict(before), dict(when), defaults


def _check_options(spec: str, obj: Callable[..., Any], options: dict[str, Any]) -> None:
    """Refuse options the reward does not take, naming the ones it does (before it is built)."""
    import inspect

    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):  # a builtin or C callable: let it report for itself
        return
    _refuse_bools_for_numbers(spec, obj, options)
    params = list(signature.parameters.values())
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return
    fixed = 0 if isinstance(obj, type) else 3  # a function reward's (samples, prompts, metadata)
    known = [p.name for p in params[fixed:] if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise UserError(f"reward {spec!r} has no option {', '.join(map(repr, unknown))}; "
                        f"it takes {', '.join(known) if known else 'no options'}")


def _refuse_bools_for_numbers(spec: str, obj: Callable[..., Any], options: dict[str, Any]) -> None:
    """YAML's ``true`` is a Python int (1): refuse it for an option annotated as a number (``max_tokens:
    true`` would otherwise ask for one token)."""
    import inspect

    try:
        signature = inspect.signature(obj, eval_str=True)
    except Exception:  # noqa: BLE001 - an annotation that cannot be evaluated: nothing to check against
        return
    for name, value in options.items():
        param = signature.parameters.get(name)
        if isinstance(value, bool) and param is not None and numeric_annotation(param.annotation):
            raise UserError(f"reward {spec!r}: {name}={value} must be a number, not true/false")
