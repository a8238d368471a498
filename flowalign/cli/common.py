"""Arguments and loading shared by the sub-commands that run a model."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from flowalign.errors import UserError
from flowalign.limits import (
    MAX_BATCH,
    MAX_COEFFICIENT,
    MAX_GROUP_SIZE,
    MAX_GUIDANCE,
    MAX_REFLECTION_TOKENS,
    MAX_ROUNDS,
    MAX_SAMPLING_STEPS,
    MAX_SEED,
    MAX_TASKS,
)
from flowalign.paths import default_model_dir
from flowalign.saved_weights import load_adapter_checked


class ChoicesOnUse(Sequence):
    """Choices listed when argparse first reads them (to check a value, or to print this command's own help),
    not when the parser is built: names that take seconds of imports to list keep ``flowalign --help`` fast."""

    def __init__(self, names: Callable[[], Iterable[str]]) -> None:
        self.names, self.listed = names, None

    def _listed(self) -> list[str]:
        if self.listed is None:
            self.listed = list(self.names())
        return self.listed

    def __getitem__(self, i: Any) -> Any:
        return self._listed()[i]

    def __len__(self) -> int:
        return len(self._listed())


def add_choice(p: argparse.ArgumentParser, *names: str, choices: Callable[[], Iterable[str]],
               **kw: Any) -> argparse.Action:
    """``p.add_argument(*names, choices=choices(), **kw)`` with the choices listed on first use
    (:class:`ChoicesOnUse`). They are set once the argument is added: ``add_argument`` formats an argument's
    choices to check its metavar, which would list them now."""
    action = p.add_argument(*names, **kw)
    action.choices = ChoicesOnUse(choices)
    return action


class Bounded:
    """An argparse ``type`` for a number in ``[lo, hi]`` (``(lo, hi]`` with ``lo_open``): a value outside,
    or a NaN / infinity, is refused with one line naming the flag and the bound, before anything runs.

    Every numeric option of every command is one of these (tests/flowalign/test_bounds.py checks), so an
    option cannot ask for unbounded memory or time; the bounds come from :mod:`flowalign.limits`."""

    def __init__(self, kind: type, lo: float, hi: float, flag: str, *, lo_open: bool = False,
                 default_hint: bool = False) -> None:
        self.kind, self.lo, self.hi, self.flag, self.lo_open = kind, lo, hi, flag, lo_open
        self.default_hint = default_hint
        self.__name__ = kind.__name__  # argparse's "invalid int value: 'x'" names the kind

    def __call__(self, text: str) -> Any:
        value = self.kind(text)  # a ValueError is argparse's own "invalid int value" message
        where = f"{self.flag} {text}"
        if isinstance(value, float) and not math.isfinite(value):
            raise UserError(f"{where}: give a finite number")
        if self.kind is int:
            if value < self.lo:
                hint = " (leave it out for the default)" if self.default_hint else ""
                if self.lo <= 0:
                    raise UserError(f"{where}: give an integer in {self.lo}..{self.hi}{hint}")
                raise UserError(f"{where}: give an integer >= {self.lo}{hint}")
            if value > self.hi:
                raise UserError(f"{where}: give an integer <= {self.hi:,} (a bound far above real use)")
            return value
        if value < self.lo or (self.lo_open and value == self.lo):
            raise UserError(f"{where}: give a number {'>' if self.lo_open else '>='} {self.lo:g}")
        if value > self.hi:
            raise UserError(f"{where}: give a number <= {self.hi:g} (a bound far above real use)")
        return value


def add_number(p: Any, *names: str, type: type, lo: float, hi: float, lo_open: bool = False,
               **kwargs: Any) -> argparse.Action:
    """``p.add_argument(*names, **kwargs)`` with a :class:`Bounded` type: ``type`` (int or float) in
    ``[lo, hi]`` (``(lo, hi]`` with ``lo_open``). ``p`` may be a parser or an argument group."""
    flag = next((n for n in names if n.startswith("--")), names[0])
    hint = kwargs.get("default", 0) is None  # "leave it out" is the fix when leaving it out means the default
    return p.add_argument(*names, type=Bounded(type, lo, hi, flag, lo_open=lo_open, default_hint=hint), **kwargs)


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="diffusers model folder (default: the embedded tiny model)")
    p.add_argument("--adapter", default=None, help="LoRA adapter folder or a checkpoints/step-XXXXXX folder")
    p.add_argument("--ema", action="store_true",
                   help="with a checkpoint folder as --adapter: use its EMA weights (what training evaluated "
                        "when trainer.ema_decay > 0) instead of the live ones")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    """Sampling steps and CFG scale, each defaulting to the model's own (``flowalign.json``)."""
    add_number(p, "--steps", type=int, lo=1, hi=MAX_SAMPLING_STEPS, default=None,
               help="sampling steps (default: the model's)")
    add_number(p, "--guidance", type=float, lo=0, hi=MAX_GUIDANCE, default=None, help="CFG scale (default: the model's)")


def add_guide_args(p: argparse.ArgumentParser) -> None:
    """RGS options of ``sample`` and ``evaluate``: a latent reward folder and its scale κ."""
    p.add_argument("--guide", default=None, metavar="REWARD_DIR",
                   help="reward-guided sampling with this latent reward folder (flowalign train-reward)")
    add_number(p, "--guide-scale", type=float, lo=0, hi=MAX_COEFFICIENT, default=None,
               help=f"κ: v_c = v - κ·‖v‖·g/‖g‖ (0 = plain sampling; default {DEFAULT_GUIDE_SCALE})")
    add_number(p, "--guide-window", type=float, lo=0, hi=1, nargs=2, default=None, metavar=("SIGMA_LO", "SIGMA_HI"),
                   help="guide only the steps with σ in [SIGMA_LO, SIGMA_HI]")
    p.add_argument("--guide-heads", nargs="+", default=None, metavar="HEAD[:WEIGHT]",
                   help="follow these heads of a several-head latent reward, each gradient normalised, weighted "
                        "(default 1) and summed (the authors' RGS preset: preference imagereward)")
    p.add_argument("--guide-bands", nargs="+", default=None, metavar="SIGMA:SCALE",
                   help="the authors' σ bands instead of --guide-scale/--guide-window: a step takes the scale of "
                        "the first band whose σ it exceeds, none below the last (their SD3 preset: 0.8:0.30 0.2:0.05)")


#: κ of ``--guide`` when neither ``--guide-scale`` nor ``--guide-bands`` is given
DEFAULT_GUIDE_SCALE = 0.05


def guide_bands(args: argparse.Namespace) -> tuple[tuple[float, float], ...] | None:
    """``--guide-bands`` as ``((σ, scale), ...)`` (None without it); a malformed band is one clear line."""
    if args.guide_bands is None:
        return None
    bands = []
    for band in args.guide_bands:
        sigma, sep, scale = band.partition(":")
        try:
            bands.append((float(sigma), float(scale)))
        except ValueError:
            sep = ""
        if not sep:
            raise UserError(f"--guide-bands {band}: give SIGMA:SCALE, e.g. --guide-bands 0.8:0.30 0.2:0.05")
    return tuple(bands)


def guide_heads(args: argparse.Namespace) -> tuple[tuple[str, ...] | None, dict[str, float] | None]:
    """``--guide-heads`` as (names, weights) (None, None without it); a malformed one is one clear line."""
    if args.guide_heads is None:
        return None, None
    names, weights = [], {}
    for item in args.guide_heads:
        name, sep, weight = item.partition(":")
        try:
            if sep:
                weights[name] = float(weight)
        except ValueError:
            name = ""
        if not name.isidentifier() or name in names:
            raise UserError(f"--guide-heads {item}: give distinct HEAD or HEAD:WEIGHT, e.g. --guide-heads preference imagereward:0.5")
        names.append(name)
    return tuple(names), weights or None


def check_guide_args(args: argparse.Namespace) -> None:
    """The ``--guide*`` options, checked before a model is loaded."""
    if args.guide is None:
        for given, flag in ((args.guide_window, "--guide-window"), (args.guide_bands, "--guide-bands"),
                            (args.guide_heads, "--guide-heads")):
            if given is not None:
                raise UserError(f"{flag} needs --guide REWARD_DIR")
        return
    if args.guide_scale is not None and args.guide_scale < 0:
        raise UserError(f"--guide-scale {args.guide_scale} must be >= 0")
    if args.guide_bands is not None and (args.guide_scale is not None or args.guide_window is not None):
        raise UserError("--guide-bands gives each σ band its own scale: drop --guide-scale and --guide-window")
    if not Path(args.guide).is_dir():
        raise UserError(f"--guide {args.guide}: no such folder; give a reward folder written by flowalign train-reward")
    from flowalign.sampling.guidance import Guidance

    Guidance(None, 0.0, bands=guide_bands(args))  # the bands' own checks, before a model is loaded
    guide_heads(args)


def load_guidance(args: argparse.Namespace, policy):
    """The :class:`Guidance` of ``--guide`` (None without it)."""
    check_guide_args(args)
    if args.guide is None:
        return None
    from flowalign.sampling.guidance import Guidance, load_latent_reward

    reward = load_latent_reward(args.guide, device=policy.device, dtype=policy.dtype)
    scale = DEFAULT_GUIDE_SCALE if args.guide_scale is None else args.guide_scale
    heads, weights = guide_heads(args)
    if heads is not None and not set(heads) <= set(getattr(reward, "head_names", [])):
        raise UserError(f"--guide-heads {' '.join(heads)}: {args.guide} has heads "
                        f"{', '.join(getattr(reward, 'head_names', [])) or 'none by name'}")
    return Guidance(reward, scale, tuple(args.guide_window) if args.guide_window else None, guide_bands(args),
                    heads, weights)


def load_guided_policy(args: argparse.Namespace):
    """``--model`` / ``--adapter`` and the ``--guide`` reward (None without it), options checked first."""
    check_guide_args(args)
    policy = load_policy(args)
    return policy, load_guidance(args, policy)


#: upper bounds of integer options, checked before any memory is spent on them (see flowalign.limits)
INT_BOUNDS = {"steps": MAX_SAMPLING_STEPS, "n": MAX_TASKS, "batch_size": MAX_BATCH, "group_size": MAX_GROUP_SIZE}


def check_positive(args: argparse.Namespace, *names: str) -> None:
    """Integer options that must be >= 1 when given (0 is an error, not "use the default"), and at most
    their bound in :data:`INT_BOUNDS`; the seeds ``--seed`` / ``--data-seed`` must lie in 0..2**63-1."""
    for name in names:
        value = getattr(args, name, None)
        flag = "--" + name.replace("_", "-")
        if value is not None and value < 1:
            default = " (leave it out for the default)" if name in ("steps", "n") else ""
            raise UserError(f"{flag} {value}: give an integer >= 1{default}")
        if value is not None and name in INT_BOUNDS and value > INT_BOUNDS[name]:
            raise UserError(f"{flag} {value}: give an integer <= {INT_BOUNDS[name]:,} (a bound far above real use)")
    for name in ("seed", "data_seed"):
        value = getattr(args, name, None)
        if value is not None and not 0 <= value <= MAX_SEED:
            raise UserError(f"--{name.replace('_', '-')} {value}: give an integer in 0..{MAX_SEED}")


def check_device(device: str) -> None:
    """``--device``: a torch device this machine has, refused in one line before a model is loaded."""
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise UserError(f"--device {device!r} is not a device; use cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        count = torch.cuda.device_count()
        if count == 0:
            raise UserError(f"--device {device}: no CUDA GPU is visible on this machine; use --device cpu")
        if dev.index is not None and dev.index >= count:
            raise UserError(f"--device {device}: this machine shows {count} GPU(s), cuda:0 to cuda:{count - 1}")
    elif dev.type == "mps" and not torch.backends.mps.is_available():
        raise UserError(f"--device {device}: Apple's MPS is not available here; use --device cpu")
    elif dev.type not in ("cpu", "cuda", "mps"):
        raise UserError(f"--device {device}: use cpu, cuda or cuda:N")


def load_policy(args: argparse.Namespace):
    """Load ``--model`` (and ``--adapter``) through the pipelines registry."""
    import pipelines

    check_device(args.device)
    model = Path(args.model) if args.model else default_model_dir()
    policy = pipelines.load(model, device=args.device, dtype=args.dtype)
    if args.adapter:
        if not Path(args.adapter).exists():
            raise UserError(f"--adapter {args.adapter}: no such folder; give a saved adapter or a checkpoints/step-XXXXXX folder")
        policy, folder = reflecting_policy(policy, Path(args.adapter), args)
        load_adapter_checked(policy, folder)
        if getattr(args, "ema", False):
            load_ema_weights(policy, folder)
    elif getattr(args, "ema", False):
        raise UserError("--ema needs --adapter: a checkpoints/step-XXXXXX folder of a run with trainer.ema_decay > 0")
    else:  # a unified model's own loop before any training (--rounds ...): its base for a umm_reflection run
        policy, _ = reflecting_policy(policy, None, args)
    return policy


def add_reflection_args(p: argparse.ArgumentParser) -> None:
    """A unified model's reflection loop (``docs/methods/umm_reflection.md``): what an ``--adapter`` of a
    ``trainer.name=umm_reflection`` run is evaluated with; each defaults to the run's own setting."""
    g = p.add_argument_group("a unified model's reflection loop (default: the adapter's run's settings)")
    add_number(g, "--rounds", type=int, lo=0, hi=MAX_ROUNDS, default=None,
               help="most reflect -> revise rounds (trainer.rounds); 0: the first image alone")
    add_number(g, "--reflection-tokens", type=int, lo=1, hi=MAX_REFLECTION_TOKENS, default=None,
               help="most tokens of one reflection (trainer.max_new_tokens)")
    g.add_argument("--stop-phrase", default=None, help="a reflection holding it ends the loop (trainer.stop_phrase)")
    add_number(g, "--reflection-temperature", type=float, lo=0, hi=MAX_COEFFICIENT, default=None,
               help="temperature of the reflections, 0: greedy (trainer.eval_temperature)")


#: the ``--`` flags of :func:`add_reflection_args` by the trainer field they stand for
REFLECTION_FLAGS = {"rounds": "rounds", "max_new_tokens": "reflection_tokens", "stop_phrase": "stop_phrase",
                    "eval_temperature": "reflection_temperature"}


def reflecting_policy(policy: Any, adapter: Path | None, args: argparse.Namespace) -> tuple[Any, Path | None]:
    """``policy`` and the folder to load ``--adapter`` from (None: no adapter). For a family that can write
    (``FamilySpec.unified``) and an adapter of a ``trainer.name=umm_reflection`` run (a run folder: its latest
    checkpoint; a checkpoint inside one), or any ``--rounds`` / ``--stop-phrase`` / ... given (with or without
    an adapter): the family's unified policy with the run's language LoRA settings (the trainer's defaults
    without a run), evaluating by its reflection loop (the run's rounds, reflection length, stop phrase and
    evaluation temperature unless the flags say otherwise; the run's ``eval_first_image_only`` or
    ``--rounds 0`` scores the first image alone). Otherwise ``policy`` and ``adapter``."""
    from flowalign import families, plugins

    family = getattr(policy, "family", None)  # a policy of no registered family cannot be wrapped
    spec = families.registry().get(family) if family in families.targets("families") else None
    flags = {field: getattr(args, flag, None) for field, flag in REFLECTION_FLAGS.items()}
    given = {k: v for k, v in flags.items() if v is not None}
    if spec is None or spec.unified is None:
        if given:
            raise UserError(f"--{REFLECTION_FLAGS[next(iter(given))].replace('_', '-')}: the {family} family "
                            "cannot write about its images; these flags are for a unified model (Qwen-Image-Edit)")
        return policy, adapter
    from flowalign.checkpoint import latest_checkpoint
    from flowalign.reflection import Reflection
    from flowalign.train import saved_run_config
    from flowalign.trainers.umm_reflection import UMMReflectionConfig

    run_dir = (None if adapter is None else adapter if (adapter / "config.yaml").is_file()
               else adapter.parent.parent if adapter.parent.name == "checkpoints" else None)
    trainer = ((saved_run_config(run_dir) if run_dir is not None else None) or {}).get("trainer") or {}
    if trainer.get("name") != "umm_reflection" and not given:
        return policy, adapter
    if run_dir is not None and adapter == run_dir:
        adapter = latest_checkpoint(run_dir)
        if adapter is None:
            raise UserError(f"--adapter {run_dir}: the run saved no checkpoint yet; give one of its "
                            "checkpoints/step-XXXXXX folders once it has")
    defaults = {k: f.default for k, f in UMMReflectionConfig.model_fields.items()}
    setting = {k: trainer.get(k, defaults[k]) for k in ("language_lora_rank", "language_lora_alpha",
                                                        "eval_first_image_only", *REFLECTION_FLAGS)}
    setting.update(given)
    unified = plugins.load_target(spec.unified)(policy, int(setting["language_lora_rank"]),
                                                float(setting["language_lora_alpha"]))
    first_only = (bool(setting["eval_first_image_only"]) and not given) or int(setting["rounds"]) == 0
    unified.reflection = None if first_only else Reflection(
        int(setting["rounds"]), int(setting["max_new_tokens"]), str(setting["stop_phrase"]),
        float(setting["eval_temperature"]))
    return unified, adapter


def load_ema_weights(policy, folder: Path) -> None:
    """Copy a checkpoint's EMA weights (:func:`flowalign.checkpoint.ema_by_name`) into the policy."""
    import torch

    from flowalign.checkpoint import ema_by_name

    if not (folder / "ema.safetensors").exists():
        raise UserError(f"--ema: {folder} has no ema.safetensors (the run had trainer.ema_decay=0, or this is not "
                        "a checkpoints/step-XXXXXX folder); drop --ema to use its live weights")
    try:
        state = ema_by_name(folder, policy.trainable)
    except ValueError as err:
        raise UserError(f"--ema: {err}; load the model with the settings it was trained with") from None
    params = dict(policy.trainable.named_parameters())
    with torch.no_grad():
        for name, value in state.items():
            if value.shape != params[name].shape:
                raise UserError(f"--ema: {name} has shape {tuple(params[name].shape)} but its EMA {tuple(value.shape)}")
            params[name].copy_(value.to(params[name]))
