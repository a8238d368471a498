"""Run configs: YAML → typed, validated objects, with dotted ``key=value`` overrides.

Every run has the same sections (``run``, ``model``, ``data``, ``rewards``, ``trainer``, ``eval``,
``parallel``). The ``trainer`` section is validated by the chosen trainer's own config class, so each
algorithm keeps its options next to its loss. Errors name the field, the bad value and the fix (with "did you mean" for
misspelt keys).
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from flowalign.errors import UserError
from flowalign.finite import non_finite_key
from flowalign.limits import (MAX_BATCH, MAX_COEFFICIENT, MAX_CONFIG_BYTES, MAX_FRAMES, MAX_GUIDANCE, MAX_IMAGE_SIDE,
                              MAX_KEEP_CHECKPOINTS, MAX_LAYERS, MAX_LORA_RANK, MAX_RANKS, MAX_SAMPLING_STEPS, MAX_SEED,
                              MAX_TASKS, MAX_TIMEOUT_S, MAX_TRAIN_STEPS)
from flowalign.yaml_load import load_yaml, yaml_problem
from flowalign.yaml_numbers import numeric_annotation


#: element types of list- and tuple-valued fields, so each element carries its bounds
#: a step (or chunk) index of the sampler's grid
StepIndex = Annotated[int, Field(ge=0, le=MAX_SAMPLING_STEPS)]
#: a kernel or softmax temperature (it divides, so 0 is refused)
Temperature = Annotated[float, Field(gt=0, le=MAX_COEFFICIENT)]
#: a fraction or a noise level σ in [0, 1]
Fraction = Annotated[float, Field(ge=0, le=1)]
#: one of Adam's betas
AdamBeta = Annotated[float, Field(ge=0, lt=1)]


class Section(BaseModel):
    """A config section: unknown keys are errors, values are validated on assignment too, numbers must
    be finite and ``true``/``false`` is not a number."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _bool_is_not_a_number(cls, value: Any, info: ValidationInfo) -> Any:
        field = cls.model_fields.get(info.field_name or "")
        if isinstance(value, bool) and field is not None and numeric_annotation(field.annotation):
            raise ValueError("expected a number, not true/false")
        return value


class RunSection(Section):
    name: str = "run"
    output_dir: str = "runs/run"
    seed: int = Field(0, ge=0, le=MAX_SEED)  # torch's and numpy's generators take 63 bits
    #: ``auto`` (newest complete checkpoint, if any), ``never``, or a checkpoint folder
    resume: str = "auto"
    checkpoint_every: int = Field(50, ge=1, le=MAX_TRAIN_STEPS)
    keep_checkpoints: int = Field(2, ge=1, le=MAX_KEEP_CHECKPOINTS)
    log_every: int = Field(1, ge=1, le=MAX_TRAIN_STEPS)
    tensorboard: bool = True
    wandb: bool = False
    wandb_project: str = "flowalign"
    #: stop with an error when more than this fraction of a batch has invalid rewards
    max_invalid_fraction: float = Field(0.5, ge=0.0, le=1.0)
    progress: bool = True
    #: the device's dense bf16 peak in TFLOP/s, the denominator of perf/mfu (null: known for H100, H200, A100 and
    #: L40S by name; on another GPU perf/mfu is not logged, perf/tflops_per_s is; on a CPU neither, unless given)
    peak_tflops: float | None = Field(None, gt=0, le=1e6)


class LoraSection(Section):
    rank: int = Field(8, ge=1, le=MAX_LORA_RANK)
    alpha: float = Field(16.0, gt=0, le=MAX_COEFFICIENT)
    target_modules: list[str] | None = None
    #: the transformer blocks that get the adapter (shallow LoRA), counted over its block lists in forward
    #: order (FLUX: double-stream then single-stream blocks): "last:N" (the last N) or a list of indices
    #: from 0; null: every block
    blocks: str | list[Annotated[int, Field(ge=0, le=MAX_LAYERS)]] | None = None
    #: under a bf16/fp16 model: ``fp32`` runs the adapter in float32 (peft's way: each adapted layer's input
    #: cast to float32), ``model`` in the model's dtype over float32 weights (as the reference code's autocast;
    #: no float32 copies of activations). The weights and the optimiser stay float32 either way
    compute_dtype: Literal["fp32", "model"] = "fp32"

    @field_validator("blocks")
    @classmethod
    def _blocks_form(cls, value: str | list[int] | None) -> str | list[int] | None:
        """``last:N`` with N in [1, MAX_LAYERS] or a non-empty list of distinct indices."""
        if isinstance(value, str):
            count = value.removeprefix("last:")
            if not value.startswith("last:") or not count.isdigit() or not 1 <= int(count) <= MAX_LAYERS:
                raise ValueError(f"model.lora.blocks {value!r}: write last:N (N from 1 to {MAX_LAYERS}, e.g. last:2) "
                                 "or a list of block indices such as [8, 9]")
        elif value is not None and (not value or len(set(value)) != len(value)):
            raise ValueError(f"model.lora.blocks {value}: give a non-empty list of distinct block indices, or last:N")
        return value


#: ``model.defaults`` keys that size or scale a sample, and their ``(low, high)`` bounds (see flowalign.limits)
DEFAULT_BOUNDS: dict[str, tuple[float, float]] = {
    "height": (16, MAX_IMAGE_SIDE), "width": (16, MAX_IMAGE_SIDE), "num_frames": (1, MAX_FRAMES),
    "num_steps": (1, MAX_SAMPLING_STEPS), "guidance_scale": (0, MAX_GUIDANCE),
}


class ModelSection(Section):
    #: a local diffusers folder (relative paths are resolved against the working directory)
    path: str = "assets/tiny-sd3-vvr"
    #: a registered model family (sd3, flux, kontext, flux2, qwen_image, qwen_image_edit, zimage, wan,
    #: hunyuan_video15, ltx2, anyflow_far, or one an installed package registers); null: detected from the folder's
    #: model_index.json
    family: str | None = None
    dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    finetune: Literal["lora", "full"] = "lora"
    lora: LoraSection = LoraSection()
    gradient_checkpointing: bool = False
    #: attention kernels through diffusers' dispatcher: native (torch SDPA, its own choice of kernel), one of SDPA's
    #: CUDA kernels pinned (_native_cudnn, _native_flash, _native_efficient) or a CUDA package's
    attention_backend: Literal["native", "_native_cudnn", "_native_flash", "_native_efficient", "flash", "_flash_3",
                               "sage", "xformers"] = "native"
    #: torch.compile each transformer block (regional compilation; the first steps compile, later ones run the
    #: compiled kernels); needs a C compiler on a CPU
    compile: bool = False
    #: float32 matrix products on a CUDA GPU in TF32 (torch.backends.cuda.matmul.allow_tf32, as the reference
    #: Flow-GRPO code sets it): under peft's float32 adapters (lora.compute_dtype=fp32) each adapted layer's
    #: products run in float32; TF32 runs them on the tensor cores with a 10-bit mantissa. Set for the whole
    #: process when the run starts; no effect on a CPU
    allow_tf32: bool = False
    #: samples the VAE decodes at once (None: the family's default, 8 for images, 2 for video); 1 decodes
    #: one video at a time, the least memory a long clip's decode can take
    decode_batch_size: int | None = Field(None, ge=1, le=MAX_BATCH)
    #: keep the text encoders in CPU memory, on the device only while a new prompt is encoded (embeddings
    #: are cached per prompt): frees T5-XXL's ~9.5 GB (bf16) of device memory for the transformer
    offload_text_encoders: bool = False
    #: sampling defaults over the folder's own (height, width, num_frames, guidance_scale, num_steps, ...; a key the
    #: model family does not read is refused, naming the family's keys; docs/models.md lists the families' own)
    defaults: dict[str, Any] = Field(default_factory=dict)

    @field_validator("defaults")
    @classmethod
    def _defaults_bounded(cls, value: dict[str, Any]) -> dict[str, Any]:
        """The sampling defaults that size or scale a sample lie within the same bounds as their options."""
        for key, (lo, hi) in DEFAULT_BOUNDS.items():
            number = value.get(key)
            if number is None:
                continue
            if isinstance(number, bool) or not isinstance(number, (int, float)):
                raise ValueError(f"{key}: expected a number, got {number!r}")
            if not lo <= number <= hi:
                raise ValueError(f"{key}={number!r}: give a value in {lo:g}..{hi:g}")
        return value

    @field_validator("family")
    @classmethod
    def _registered_family(cls, value: str | None) -> str | None:
        if value is not None:
            from flowalign import families

            known = families.names()
            if value not in known:
                raise ValueError(f"unknown family; registered families are {', '.join(known)}")
        return value


class ParallelSection(Section):
    """How ranks share the work (``torchrun`` / ``accelerate launch``); one process ignores all but ``strategy``.

    ``ddp``: every rank holds the whole model and optimiser, gradients are averaged. ``fsdp``: torch
    FSDP2 shards the trained transformer's weights, gradients and optimiser state over the ranks
    (block by block), see docs/guide/multi-gpu.md.
    """

    strategy: Literal["ddp", "fsdp"] = "ddp"
    #: fsdp: keep the sharded parameters and the optimiser state in CPU memory (the optimiser steps on CPU)
    cpu_offload: bool = False
    #: fsdp: free each block's gathered weights after its forward (gathered again for backward)
    reshard_after_forward: bool = True
    #: fsdp: ``bf16`` gathers weights and computes in bf16, reduces gradients in fp32; the stored shards
    #: (and the optimiser state) keep model.dtype, so use model.dtype=fp32 for fp32 master weights
    mixed_precision: Literal["no", "bf16"] = "no"
    #: a collective waiting longer than this (a rank died or hangs) stops the run with an error
    timeout_s: float = Field(1800.0, gt=0, le=MAX_TIMEOUT_S)
    #: split each sample's tokens over this many processes (diffusers' context parallelism): N processes are
    #: N/S data ranks × S sequence ranks, each holding 1/S of a block's activations; see docs/guide/multi-gpu.md
    sequence_parallel: int = Field(1, ge=1, le=MAX_RANKS)
    #: how attention sees every token: ``ulysses`` (all-to-all of heads; the degree must divide the head count)
    #: or ``ring`` (key/value blocks passed around; needs a backend returning log-sum-exp, e.g. flash)
    sequence_parallel_attention: Literal["ulysses", "ring"] = "ulysses"


class DataSection(Section):
    """Training prompts: a text/JSONL file (``prompts``) or tasks drawn from a benchmark generator."""

    prompts: str | None = None
    bench: str | None = "vvr"
    level: str | list[str] = "medium"
    n: int = Field(2000, ge=1, le=MAX_TASKS)  # each task is built in memory: the bound only stops a typo
    seed: int = Field(0, ge=0, le=MAX_SEED,
                      description="task seed; benchmark splits use seeds >= 1000, keep training below")


#: a reward call's default deadline (seconds): far above a real reward model's batch (seconds, a minute for a
#: large judge loading lazily), so only a hang meets it
REWARD_TIMEOUT_S = 600.0


class RewardSpec(BaseModel):
    """One reward of the weighted sum; keys other than ``name`` and ``weight`` are its options (a bare name
    stands for ``{name: NAME}``)."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    name: str
    #: a negative weight penalises the reward
    weight: float = Field(1.0, ge=-MAX_COEFFICIENT, le=MAX_COEFFICIENT)
    #: seconds one call may take; a call still running then is abandoned and its batch invalid
    timeout_s: float = Field(REWARD_TIMEOUT_S, gt=0, le=MAX_TIMEOUT_S)
    #: the name its scores, logs and advantages go by (two entries of one reward need two labels); null: its name
    label: str | None = Field(None, min_length=1, max_length=100)
    #: the value of a sample this reward leaves invalid (a judge's reply without a score, a lone sample of a
    #: pairwise judge, a failed or timed-out call), as some authors' scripts score them (e.g. 0); null: masked,
    #: the sample left out of its group's advantages. Its invalid fraction is logged either way
    invalid_value: float | None = Field(None, ge=-MAX_COEFFICIENT, le=MAX_COEFFICIENT)
    #: frames per second of the mp4 file each video is written to and read back from before this reward scores
    #: it, as DanceGRPO's and Pref-GRPO's video scripts score their rewards (flowalign.video_file); null: the
    #: decoded frames as they are
    video_mp4_fps: int | None = Field(None, ge=1, le=240)

    @model_validator(mode="before")
    @classmethod
    def _name_alone(cls, data: Any) -> Any:
        """A bare name (``rewards: [pickscore]``) is a reward with its default options."""
        return {"name": data} if isinstance(data, str) else data

    @property
    def options(self) -> dict[str, Any]:
        return dict(self.model_extra or {})

    @property
    def key(self) -> str:
        """The name the reward's scores go by: its label, else its name."""
        return self.label or self.name


def check_reward_keys(specs: list[RewardSpec], where: str) -> None:
    """Refuse two entries of ``specs`` going by one name (their scores and logs would mix), naming the fix."""
    seen: set[str] = set()
    for spec in specs:
        if spec.key in seen:
            raise UserError(f"{where}: reward {spec.key!r} is given twice; give the second a label "
                            f"(e.g. {{name: {spec.name}, label: {spec.name}_b, ...}})")
        seen.add(spec.key)


def reward_spec_from_text(text: str, option: str) -> RewardSpec:
    """A reward given on the command line (``--reward``, ``serve-reward SPEC``): a name (``pickscore``,
    ``pkg.module:attr``) or the YAML mapping a config's ``rewards:`` list holds
    (``"{name: pickscore, path: /weights/pickscore}"``)."""
    try:
        data = load_yaml(text, option)
    except yaml.YAMLError as e:
        raise UserError(f"{option} {text!r} is not valid YAML ({yaml_problem(e)}); give a reward name or a "
                        "mapping such as \"{name: pickscore, path: /weights/pickscore}\"") from None
    if isinstance(data, str):
        data = {"name": data}
    if not isinstance(data, dict):
        raise UserError(f"{option} {text!r}: give a reward name or a mapping with a name, e.g. "
                        "\"{name: pickscore, path: /weights/pickscore}\"")
    try:
        return RewardSpec.model_validate(data)
    except ValidationError as e:
        raise UserError(f"{option} {text!r}: {format_validation_error(e, RewardSpec)}") from None


class EvalSection(Section):
    #: evaluate every N training steps (0: only before and after training)
    every: int = Field(25, ge=0, le=MAX_TRAIN_STEPS)
    #: evaluate the starting weights too (step 0)
    at_start: bool = True
    bench: str | None = "vvr"
    #: a prompt file (as data.prompts reads) evaluated instead of eval.bench, scored by eval.rewards
    prompts: str | None = None
    #: options of the benchmark's own reward (e.g. geneval's path and clip_path)
    reward_options: dict[str, Any] = Field(default_factory=dict)
    level: str = "medium"
    n: int | None = Field(64, ge=1, le=MAX_TASKS)
    #: which split to evaluate on: validation (the default, so nothing is tuned on test) or test
    split: Literal["validation", "test"] = "validation"
    #: None: the shipped split; an int: a fresh split of the same distribution drawn with that seed
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    num_steps: int | None = Field(None, ge=1, le=MAX_SAMPLING_STEPS)
    batch_size: int = Field(16, ge=1, le=MAX_BATCH)
    gallery: bool = True
    #: a held-out panel of rewards (the ``rewards:`` list's form) scored on every evaluation's samples,
    #: logged as ``eval/<name>``: rewards the run does not train on, to see it game the one it does
    rewards: list[RewardSpec] = Field(default_factory=list)


class TrainConfig(Section):
    run: RunSection = RunSection()
    model: ModelSection = ModelSection()
    data: DataSection = DataSection()
    #: may be empty for a trainer that learns without a reward (SOAR, SFT); the trainer checks
    rewards: list[RewardSpec] = Field(default_factory=lambda: [RewardSpec(name="vvr")])
    #: validated by the trainer named in ``trainer.name``
    trainer: dict[str, Any] = Field(default_factory=lambda: {"name": "flow_grpo"})
    eval: EvalSection = EvalSection()
    parallel: ParallelSection = ParallelSection()

    @model_validator(mode="before")
    @classmethod
    def _finite(cls, data: Any) -> Any:
        """Free-form parts (reward options, ``model.defaults``, the trainer section) hold finite numbers too."""
        bad = non_finite_key(data)
        if bad:
            raise ValueError(f"{bad[0]}: {bad[1]} is not a finite number; give a finite value")
        return data


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``a.b.c=value`` overrides in place; each value is read as YAML (``lr=1e-4``, ``x='[1,2]'``)."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise UserError(f"override {item!r} is not key=value (e.g. trainer.lr=1e-4)")
        try:
            value = load_yaml(raw, f"override {key}") if raw != "" else None
        except yaml.YAMLError as e:
            problem = yaml_problem(e)
            raise UserError(f"override {key}: {raw!r} is not valid YAML ({problem}); quote text values, "
                            f"e.g. {key}='\"...\"', and close brackets") from None
        node = data
        parts = key.split(".")
        for part in parts[:-1]:
            if not isinstance(node.get(part, {}), dict):
                raise UserError(f"override {key}: {part!r} is not a section")
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    return data


def _suggest(word: str, options: list[str]) -> str:
    close = difflib.get_close_matches(word, options, n=1)
    return f" (did you mean {close[0]!r}?)" if close else f" (known: {', '.join(sorted(options))})"


def format_validation_error(err: ValidationError, model: type[BaseModel], prefix: str = "") -> str:
    """One line per problem: ``field: message (value ...)``, with a suggestion for unknown keys."""
    lines = []
    for e in err.errors():
        loc = [str(p) for p in e["loc"]]
        where = prefix + ".".join(loc)
        if e["type"] == "extra_forbidden":
            fields = _fields_at(model, loc[:-1])
            lines.append(f"{where}: unknown key{_suggest(loc[-1], fields)}")
        elif not loc:  # a whole-config check names its key itself
            lines.append(e["msg"].removeprefix("Value error, "))
        else:
            lines.append(f"{where}: {e['msg'].removeprefix('Value error, ')} (got {e.get('input')!r})")
    return "; ".join(lines)


def _fields_at(model: type[BaseModel], loc: list[str]) -> list[str]:
    for part in loc:
        field = model.model_fields.get(part)
        ann = getattr(field, "annotation", None) if field else None
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            model = ann
        else:
            return []
    return list(model.model_fields)


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> TrainConfig:
    """Read a YAML run config (or only overrides when ``path`` is None) into a validated TrainConfig."""
    data: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        try:
            text = read_text_file(path, "config file", "a YAML file such as configs/tiny/flow_grpo_vvr.yaml",
                                  max_bytes=MAX_CONFIG_BYTES)
            data = load_yaml(text, f"config file {path}") or {}
        except yaml.YAMLError as e:
            raise UserError(f"config file {path} is not valid YAML ({yaml_problem(e)}); fix that line") from None
        if not isinstance(data, dict):
            raise UserError(f"config file {path} must hold a mapping of sections (run, model, trainer, ...)")
    apply_overrides(data, overrides or [])
    try:
        return TrainConfig.model_validate(data)
    except ValidationError as e:
        raise UserError(f"invalid config: {format_validation_error(e, TrainConfig)}") from None


def read_text_file(path: Path, what: str, example: str, max_bytes: int | None = None) -> str:
    """The UTF-8 text of ``path``, or a one-line ``UserError`` for a missing file, a folder, other bytes or
    (with ``max_bytes``) a file larger than that, refused before it is read."""
    if not path.exists():
        raise UserError(f"{what} {path} does not exist; pass {example}")
    if path.is_dir():
        raise UserError(f"{what} {path} is a folder, not a file; pass {example}")
    if max_bytes is not None and path.stat().st_size > max_bytes:
        raise UserError(f"{what} {path} is {path.stat().st_size / 2**20:.1f} MiB, more than the "
                        f"{max_bytes / 2**20:.0f} MiB such a file can be; pass {example}")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{what} {path} is not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start}); "
                        "save it as UTF-8") from None


def changed(section: BaseModel, option: str) -> bool:
    """Whether ``option`` was given a value other than its default: what a form that does not read the option
    refuses. A run's saved config states every option, most at their defaults; run again, it is not refused."""
    if option not in section.model_fields_set:
        return False
    return getattr(section, option) != type(section).model_fields[option].get_default(call_default_factory=True)


def validate_section(section: type[BaseModel], data: dict[str, Any], prefix: str) -> Any:
    """Validate a free-form section (the trainer's) with its own model, errors prefixed by its path."""
    try:
        return section.model_validate(data)
    except ValidationError as e:
        raise UserError(f"invalid config: {format_validation_error(e, section, prefix)}") from None


def dump_config(cfg: TrainConfig, trainer_cfg: BaseModel | None = None) -> str:
    """The resolved config as YAML (the trainer section with all its defaults filled in, and each reward's
    options whose default changed: :func:`recorded_reward`)."""
    data = cfg.model_dump(mode="json")
    if trainer_cfg is not None:  # with the user's spelling of the name (a path or entry point stays one)
        data["trainer"] = {**trainer_cfg.model_dump(mode="json"), "name": cfg.trainer.get("name", trainer_cfg.name)}
    data["rewards"] = [recorded_reward(entry) for entry in data["rewards"]]
    data["eval"]["rewards"] = [recorded_reward(entry) for entry in data["eval"]["rewards"]]
    return yaml.safe_dump(data, sort_keys=False)


def recorded_reward(entry: dict[str, Any]) -> dict[str, Any]:
    """A ``rewards:`` entry as a run records it: the user's options, plus the current default of each option
    whose default changed (the reward's ``before``), so that the saved config states what the run computes
    even after that default changes again. Other options stay as written (a reward's defaults are its own)."""
    from flowalign.plugins import reward_former_forms

    before, _, defaults = reward_former_forms(str(entry["name"]))
    # unlabelled, it goes by its name; without an invalid_value, its invalid samples are masked; without a
    # video_mp4_fps, it reads the decoded frames
    entry = {k: v for k, v in entry.items() if k not in ("label", "invalid_value", "video_mp4_fps") or v is not None}
    return {**entry, **{k: defaults[k] for k in before if k not in entry}}
