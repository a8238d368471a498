"""Write docs/guide/configuration.md from the config classes, so the reference cannot drift from the code.

Every section of a run config (the pydantic sections of ``flowalign.config.TrainConfig``) and every
trainer's own options (each ``Config`` class reached through ``flowalign.trainers.TRAINERS``) become a
table: key, type (with its bounds), default and one line of meaning. The meaning is the field's
``Field(description=...)`` when it has one, else the ``#:`` comment lines right above the field in its
class (inherited fields take the comment of the class that declared them), else a line from
``FALLBACK`` below.

    python scripts/config_reference.py            # rewrite docs/guide/configuration.md
    python scripts/config_reference.py --check    # exit 1 when the committed page is stale
"""

from __future__ import annotations

import argparse
import functools
import inspect
import re
import sys
import types
import typing
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

from pydantic import BaseModel  # noqa: E402
from pydantic.fields import FieldInfo  # noqa: E402

OUTPUT = ROOT / "docs" / "guide" / "configuration.md"

#: meanings for fields whose class carries neither a description nor a ``#:`` comment, by section and key
FALLBACK = {
    "run.name": "the run's name in logs, TensorBoard and W&B",
    "run.output_dir": "the run folder: config, metrics, checkpoints, evaluations and gallery",
    "run.seed": "seed of the prompt order and of all sampling noise (with the step and group)",
    "run.checkpoint_every": "save a checkpoint every N training steps (and always at the end)",
    "run.keep_checkpoints": "how many of the newest checkpoints to keep",
    "run.log_every": "write metrics every N steps",
    "run.tensorboard": "write TensorBoard events into the run folder",
    "run.wandb": "log to Weights & Biases (needs the `wandb` package)",
    "run.wandb_project": "the W&B project name",
    "run.progress": "show a progress bar",
    "model.family": "a registered family (`flowalign.families`); null: read from the folder's `model_index.json`",
    "model.dtype": "weights' dtype (step math always runs in float32)",
    "model.finetune": "train a LoRA adapter or the full transformer",
    "model.lora": "the LoRA adapter (used when `finetune: lora`)",
    "model.gradient_checkpointing": "recompute the transformer's activations in the backward pass to save memory",
    "model.lora.rank": "LoRA rank r",
    "model.lora.alpha": "LoRA scale α (the update is scaled by α/r)",
    "model.lora.target_modules": "module names to adapt; null: the family's attention projections",
    "data.prompts": "a text file (one prompt a line) or JSONL of prompts; overrides `bench`",
    "data.bench": "benchmark whose task generator supplies training prompts (`vvr`, `vvr_motion`)",
    "data.level": "task level(s) to draw: `easy`, `medium`, `hard`, or a list",
    "data.n": "number of training tasks drawn",
    "rewards.name": "a registered reward name, `module:function`, or an entry-point name",
    "rewards.weight": "the reward's weight in the weighted sum",
    "eval.bench": "benchmark of the held-out evaluation (null: no evaluation)",
    "eval.prompts": "a prompt file (`.txt` or `.jsonl`, as `data.prompts` reads) evaluated instead of `bench`, "
                    "its first `n` prompts scored by `eval.rewards` (e.g. PickScore's held-out prompts)",
    "eval.reward_options": "options of the benchmark's own reward, e.g. `{path: DIR, clip_path: DIR}` for `geneval`",
    "eval.level": "task level of the evaluation",
    "eval.n": "number of evaluation tasks (null: the whole split)",
    "eval.num_steps": "sampling steps at evaluation (null: the model's default)",
    "eval.batch_size": "samples per evaluation batch",
    "eval.gallery": "rebuild `gallery/index.html` after each evaluation",
    "eval.rewards.name": "a registered reward name, `module:function`, or an entry-point name (a `label:` option "
                         "names its column instead)",
    "eval.rewards.weight": "unused: the panel's rewards are reported side by side, never summed",
    "parallel.strategy": "`ddp`: every rank holds the whole model, gradients averaged; `fsdp`: FSDP2 shards weights, "
                         "gradients and optimiser state",
    "trainer.name": "which trainer runs (see the sections below)",
    "trainer.max_steps": "stop after this many training steps",
    "trainer.group_size": "samples per prompt (a group: advantages compare its members)",
    "trainer.behaviour_max": "cap of λ_s (see `behaviour_rate`)",
    "trainer.logit_std": "standard deviation of the logit-normal σ density (see `logit_mean`)",
    "trainer.lr": "AdamW learning rate",
    "trainer.lr_warmup_steps": "linear warm-up steps of the learning rate",
    "trainer.lr_min_ratio": "the cosine schedule ends at this fraction of `lr`",
    "trainer.weight_decay": "AdamW weight decay",
    "trainer.betas": "AdamW betas",
    "trainer.grad_clip": "clip the gradient norm to this value before each optimiser step",
    "trainer.guidance_scale": "CFG scale of rollouts (null: the model's default)",
    "trainer.inner_epochs": "passes over each step's rollouts",
    "trainer.advantage": "advantage strategy: `group`, `global_std`, `gdpo` or `win_rate`",
    "trainer.adv_clip": "clip advantages to ±this value",
    "trainer.ema_decay": "decay of the EMA of the trained weights used for evaluation (0: no EMA)",
    "trainer.ema_every": "update the EMA every N optimiser steps",
    "trainer.sampler": "rollout SDE: the Flow-GRPO SDE or CPS",
    "trainer.cps_log_prob": "CPS log-probability as the authors coded it (`code`) or the exact Gaussian one",
    "trainer.clip_range": "PPO clip range ε of the probability ratio",
    "trainer.beta": "weight β of the KL to the adapter-disabled reference (LoRA only)",
    "trainer.kl_mode": "KL as the authors coded it (`code`, per-element mean) or the exact Gaussian KL",
    "trainer.rectify": "temporal gradient rectification (weight each sample by ω ∝ 1/c_k)",
    "trainer.eta": "η: ascent step size as a fraction of the budget per step",
    "trainer.sigma_min": "floor of σ̃ in the correction target's denominator",
    "trainer.feature": "feature map ϕ of the KDE: pooled latent, whole latent, or pooled decoded image",
    "trainer.feature_size": "side of the average-pooled feature grid",
    "trainer.core": "CoRe reward refits during training (null: a fixed latent reward)",
    "trainer.core.batch_size": "preference pairs per Bradley-Terry minibatch",
    "trainer.core.lr": "Adam learning rate of the refits",
}


# ---------------------------------------------------------------------------------------------- comments


@functools.cache  # reading a class's source parses its whole module: once per class, not once per field
def _comment_blocks(cls: type) -> dict[str, str]:
    """``{field: text}`` from the ``#:`` comment lines right above each field in ``cls``'s own source (shared:
    read it, do not change it)."""
    try:
        lines = inspect.getsource(cls).splitlines()
    except (OSError, TypeError):
        return {}
    header_end = next((k for k, ln in enumerate(lines) if ln.rstrip().endswith(":")), 0)  # a class line may wrap
    body = [ln for ln in lines[header_end + 1:] if ln.strip()]
    if not body:
        return {}
    indent = len(body[0]) - len(body[0].lstrip())
    field_re = re.compile(r"^ {%d}(\w+)\s*:" % indent)
    out: dict[str, str] = {}
    for i, line in enumerate(lines):
        m = field_re.match(line)
        if not m:
            continue
        j, block = i - 1, []
        while j > 0 and lines[j].strip().startswith("#"):
            block.insert(0, lines[j].strip())
            j -= 1
        if any(b.startswith("#:") for b in block):
            start = next(k for k, b in enumerate(block) if b.startswith("#:"))
            text = " ".join(re.sub(r"^#:?\s?", "", b) for b in block[start:])
            out[m.group(1)] = text.replace("``", "`").strip()
    return out


def meaning(model: type[BaseModel], name: str, path: str) -> str:
    """One line for ``model.name``: description, else the declaring class's ``#:`` comment, else FALLBACK."""
    field = model.model_fields[name]
    if field.description:
        return field.description.replace("``", "`")
    for cls in model.__mro__:
        if not (isinstance(cls, type) and issubclass(cls, BaseModel)):
            continue
        if name in cls.__dict__.get("__annotations__", {}):
            text = _comment_blocks(cls).get(name)
            if text:
                return text
    return FALLBACK.get(f"{path}.{name}", "")


# ---------------------------------------------------------------------------------------------- rendering


def type_name(ann: Any) -> str:
    """A short readable name of a type annotation: ``int``, ``"a" | "b"``, ``float | None``, ``list[str]``."""
    origin = typing.get_origin(ann)
    if ann is type(None):
        return "null"
    if origin is typing.Literal:
        return " | ".join(f'"{a}"' if isinstance(a, str) else str(a) for a in typing.get_args(ann))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in typing.get_args(ann))
    if origin is not None:
        args = ", ".join(type_name(a) for a in typing.get_args(ann))
        return f"{getattr(origin, '__name__', str(origin))}[{args}]"
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return "section"
    if ann is Any:
        return "any"
    return getattr(ann, "__name__", str(ann))


_BOUNDS = (("ge", "≥"), ("gt", ">"), ("le", "≤"), ("lt", "<"))


def bounds(field: FieldInfo) -> str:
    """Numeric bounds and patterns from the field's metadata: ``≥ 1``, ``> 0, ≤ 1``."""
    parts = []
    for item in field.metadata:
        for attr, sym in _BOUNDS:
            value = getattr(item, attr, None)
            if value is not None:
                parts.append(f"{sym} {value}")
        pattern = getattr(item, "pattern", None)
        if pattern:
            parts.append(f"matches `{pattern}`")
    return ", ".join(parts)


def default_text(field: FieldInfo) -> str:
    if field.is_required():
        return "required"
    value = field.get_default(call_default_factory=True)
    if isinstance(value, BaseModel):
        return "(section)"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list) and value and isinstance(value[0], BaseModel):
        return ", ".join(str(v.model_dump()) for v in value)
    if isinstance(value, (dict, list, tuple)) and not value:
        return "{}" if isinstance(value, dict) else "[]"
    return str(value)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _code(text: str) -> str:
    return f"`{text}`" if text else ""


def table(model: type[BaseModel], path: str, names: list[str] | None = None) -> list[str]:
    """Markdown rows for the fields ``names`` (default: all) of ``model``, keys shown as ``path.key``."""
    rows = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for name in names if names is not None else list(model.model_fields):
        field = model.model_fields[name]
        kind = type_name(field.annotation)
        extra = bounds(field)
        kind_cell = _code(kind) + (f" ({extra})" if extra else "")
        rows.append(f"| `{name}` | {_cell(kind_cell)} | {_cell(_code(default_text(field)))} | "
                    f"{_cell(meaning(model, name, path))} |")
    return rows


def nested_sections(model: type[BaseModel]) -> list[tuple[str, type[BaseModel]]]:
    """Fields of ``model`` that are themselves sections (``X``, ``X | None`` or ``list[X]``)."""
    out = []
    for name, field in model.model_fields.items():
        candidates = [field.annotation, *typing.get_args(field.annotation)]
        for ann in candidates:
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                out.append((name, ann))
                break
    return out


# ---------------------------------------------------------------------------------------------- page

INTRO = """\
# Configuration reference

<!-- Generated by scripts/config_reference.py from the config classes. Do not edit by hand:
     run `python scripts/config_reference.py` after changing a config class. -->

A run is one YAML file with the sections below. `flowalign train CONFIG key=value ...` applies dotted
overrides on top (each value is read as YAML: `trainer.lr=1e-4`, `'data.level=[easy, medium]'`).
Unknown keys and out-of-range values are errors that name the field, the value and the allowed range
(with "did you mean" for a misspelt key). A key given twice in one mapping (`{a: 1, a: 2}` included) is an
error naming both lines, and so is a file whose aliases (`*name`) expand to more than 100,000 values or a file
over 10 MiB. Every number has a lower and an upper bound (shown below; `flowalign/limits.py` says why each
is where it is), far above real use: they stop a typo such as `data.n=1e12` or
`trainer.updates_per_epoch=1e9` before it fills the memory. The run folder's `config.yaml` holds the resolved
config with every default filled in. How the sections fit together: [training](training.md).
"""


def _section(title: str, model: type[BaseModel], path: str, names: list[str] | None = None,
             note: str = "") -> list[str]:
    lines = [f"## {title}", ""]
    doc = inspect.cleandoc(model.__doc__ or "") if model.__doc__ and model.__doc__ != BaseModel.__doc__ else ""
    if note:
        lines += [note, ""]
    elif doc and not doc.startswith(model.__name__ + "("):
        lines += [doc.split("\n\n")[0].replace("\n", " ").replace("``", "`"), ""]
    lines += table(model, path, names) + [""]
    for name, sub in nested_sections(model):
        if names is None or name in names:
            lines += _section(f"{path}.{name}", sub, f"{path}.{name}")
    return lines


def _common_base(configs: list[type[BaseModel]]) -> type[BaseModel]:
    """The most derived class every trainer config inherits from (the options all trainers share)."""
    for cls in configs[0].__mro__:
        if all(issubclass(c, cls) for c in configs) and issubclass(cls, BaseModel):
            return cls
    raise ValueError("the trainer configs share no pydantic base class")


def _differs(cfg: type[BaseModel], base: type[BaseModel], name: str) -> bool:
    if name not in base.model_fields:
        return True
    a, b = cfg.model_fields[name], base.model_fields[name]
    return (a.annotation != b.annotation or default_text(a) != default_text(b) or bounds(a) != bounds(b)
            or meaning(cfg, name, "trainer") != meaning(base, name, "trainer"))


def trainer_sections() -> list[str]:
    from flowalign.trainers import TRAINERS, get_trainer

    configs = {name: get_trainer(name).Config for name in TRAINERS}
    base = _common_base(list(configs.values()))
    lines = _section("trainer: options every trainer shares", base, "trainer",
                     note="`trainer.name` picks the trainer; the trainer's own config class validates the whole "
                          "section. These keys exist for every trainer; the sections after this one list what "
                          "each trainer adds or sets to another default.")
    for name, cfg in configs.items():
        parent = _parent_trainer(name, configs)
        ref = configs[parent] if parent else base
        own = [f for f in cfg.model_fields if f != "name" and _differs(cfg, ref, f)]
        scope = f"`{parent}`'s keys" if parent else "the shared keys"
        lines += [f"## trainer: `{name}`", "",
                  f"`trainer.name: {name}` ([method](../methods/{name}.md)). "
                  + (f"All of {scope}, and these added or with another default:" if own
                     else f"No keys beyond {scope}."), ""]
        if own:
            lines += table(cfg, "trainer", own) + [""]
            for sub_name, sub in nested_sections(cfg):
                if sub_name in own:
                    lines += _section(f"trainer.{sub_name} (`{name}`)", sub, f"trainer.{sub_name}")
    return lines


def _parent_trainer(name: str, configs: dict[str, type[BaseModel]]) -> str | None:
    """The trainer whose config class ``name``'s extends (nearest in the MRO), if any."""
    for cls in configs[name].__mro__[1:]:
        for other, other_cfg in configs.items():
            if other != name and other_cfg is cls:
                return other
    return None


def render() -> str:
    from flowalign.config import TrainConfig

    lines = [INTRO]
    for name, sub in nested_sections(TrainConfig):
        is_list = typing.get_origin(TrainConfig.model_fields[name].annotation) is list
        title = f"{name} (a list; each item)" if is_list else name
        note = ""
        if is_list:
            own = typing.get_args(TrainConfig.model_fields[name].annotation)[0].model_fields
            listed = ", ".join(f"`{key}`" for key in list(own)[:-1]) + f" and `{list(own)[-1]}`"
            note = (f"A weighted sum of rewards. Keys other than {listed} are the reward's own options "
                    f"(see [rewards](rewards.md)). Default: `{default_text(TrainConfig.model_fields[name])}`.")
        lines += _section(title, sub, name, note=note)
    lines += trainer_sections()
    return "\n".join(lines).rstrip() + "\n"


def missing_meanings() -> list[str]:
    """Keys the page shows without a meaning (a field with no description, comment or fallback)."""
    return [ln for ln in render().splitlines() if ln.startswith("| `") and ln.rstrip().endswith("|  |")]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when the page differs from the code's")
    ap.add_argument("--out", type=Path, default=OUTPUT, help="the page to write or check")
    args = ap.parse_args(argv)
    text = render()
    if args.check:
        if not args.out.exists() or args.out.read_text() != text:
            print(f"{args.out} is stale: run python scripts/config_reference.py", file=sys.stderr)
            return 1
        return 0
    from flowalign.io import atomic_path

    with atomic_path(args.out) as tmp:
        tmp.write_text(text)
    print(f"wrote {args.out}")
    for row in missing_meanings():
        print(f"warning: no meaning for {row.split('|')[1].strip()}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
