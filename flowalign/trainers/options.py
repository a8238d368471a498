"""The ``trainer:`` section's options, in groups a trainer's own config is assembled from.

A trainer's ``Config`` holds only the options it reads: :class:`TrainerConfig` (what the loop reads for
every trainer: the budget, the optimiser and its schedule, the EMA) plus the groups its hooks use, e.g.
``class FlowGRPOConfig(TrainerConfig, RolloutOptions, AdvantageOptions, EpochOptions, ReferenceOptions)``.
A key the chosen trainer does not read is an error naming the trainer
(:func:`flowalign.trainers.trainer_config`), so a setting never silently does nothing.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from flowalign.config import AdamBeta, Section
from flowalign.limits import (MAX_BATCH, MAX_COEFFICIENT, MAX_GROUP_SIZE, MAX_GUIDANCE, MAX_LR, MAX_MINUTES,
                              MAX_SAMPLING_STEPS, MAX_TRAIN_STEPS, MAX_UPDATES)

#: former keys already reported in this process (one deprecation line each, however often a config is read)
_REPORTED_RENAMES: set[tuple[str, str]] = set()


class TrainerConfig(Section):
    """What the loop reads for every trainer: its name, the budget, the optimiser and its schedule, the EMA."""

    #: ``{former key: key}`` of renamed options: a former key is still read, with one deprecation line
    renamed: ClassVar[dict[str, str]] = {}
    #: ``{former key: what to write instead}`` of options that changed meaning: refused, saying so
    refused: ClassVar[dict[str, str]] = {}
    #: ``{key: value}`` of options added after runs of this trainer were saved whose default is not what those
    #: runs computed: the value that is (a run saved without the key resumes only with it, see
    #: :func:`flowalign.train.check_run_dir`)
    before: ClassVar[dict[str, Any]] = {}
    #: ``{key: (option, values)}`` of :attr:`before` entries whose former value computed something else only
    #: where the run's ``option`` is one of ``values`` (``gdpo_std`` under ``advantage: gdpo``): elsewhere a run
    #: saved without the key resumes under the default
    before_when: ClassVar[dict[str, tuple[str, tuple[Any, ...]]]] = {}

    name: str
    max_steps: int = Field(100, ge=1, le=MAX_TRAIN_STEPS)
    #: also stop once this many minutes were spent training (evaluations excluded); None: no limit
    max_minutes: float | None = Field(None, gt=0, le=MAX_MINUTES)
    #: what max_minutes counts: "wall" seconds, or "cpu" seconds of this process (all its threads), so a
    #: run sharing its cores with other work still trains the same compute (time/cpu_minutes in the logs)
    budget_clock: Literal["wall", "cpu"] = "wall"
    #: AdamW learning rate; at most 1 (real ones are 1e-6 to 1e-2, a larger one blows the weights up in a step)
    lr: float = Field(1e-4, gt=0, le=MAX_LR)
    #: "cosine": decay to lr_min_ratio·lr by the end of the budget (max_steps, or max_minutes when that
    #: ends the run first; a time-based schedule makes the LR depend on measured step times)
    lr_schedule: Literal["constant", "cosine"] = "constant"
    lr_warmup_steps: int = Field(0, ge=0, le=MAX_TRAIN_STEPS)
    #: the warm-up's first factor s: the LR rises linearly from s·lr at step 0 to lr at step lr_warmup_steps
    #: (torch's LinearLR, as accelerate-driven SFT runners warm up); null: (step + 1)/lr_warmup_steps of lr
    lr_warmup_start: float | None = Field(None, ge=0, le=1)
    lr_min_ratio: float = Field(0.1, ge=0, le=1)
    #: "cosine" over this many steps, then lr_min_ratio·lr held to the end (FestDPO's text-to-image schedule:
    #: 300 steps, then constant); None: over the whole budget
    lr_decay_steps: int | None = Field(None, ge=1, le=MAX_TRAIN_STEPS)
    weight_decay: float = Field(1e-4, ge=0, le=MAX_COEFFICIENT)
    #: Adam's (β1, β2), each in [0, 1)
    betas: tuple[AdamBeta, AdamBeta] = (0.9, 0.999)
    grad_clip: float = Field(1.0, gt=0, le=MAX_COEFFICIENT)
    #: AdamW's kernels: "auto", PyTorch's choice (a multi-tensor kernel per operation over all the tensors on a
    #: GPU, a loop over them on a CPU); "fused", one kernel for the whole update (``AdamW(fused=True)``; the
    #: same arithmetic, rounded differently)
    optimizer_kernel: Literal["auto", "fused"] = "auto"
    ema_decay: float = Field(0.0, ge=0, lt=1)
    ema_every: int = Field(8, ge=1, le=MAX_TRAIN_STEPS)
    #: true: flow_grpo's EMAModuleWrapper schedule (decay min(ema_decay, (1+s)/(10+s)) after s optimiser
    #: steps, moving when (s+1) % ema_every == 0), as the Flow-GRPO, DiffusionNFT and DiffusionOPSD scripts
    #: run it; false: a constant decay, moving when s % ema_every == 0
    ema_warmup: bool = False
    #: flow_grpo's train_sd3.py moves the average after every micro-batch (its gradient_accumulation_steps
    #: calls per optimiser step, all but the last with the weights before the step); 1: once per step
    ema_micro_batches: int = Field(1, ge=1, le=MAX_TRAIN_STEPS)

    @model_validator(mode="before")
    @classmethod
    def _former_keys(cls, data: Any) -> Any:
        """Refuse each key of :attr:`refused`; read each former key of :attr:`renamed` as its new name
        (saying so once); both given: an error."""
        if not isinstance(data, dict):
            return data
        for old, instead in cls.refused.items():
            if old in data:
                raise ValueError(f"trainer.{old} is no longer an option of this trainer: {instead}")
        if not any(old in data for old in cls.renamed):
            return data
        data = dict(data)
        for old, new in cls.renamed.items():
            if old not in data:
                continue
            if new in data:
                raise ValueError(f"trainer.{old} and trainer.{new} are the same option ({old} is its former name): "
                                 f"give only trainer.{new}")
            data[new] = data.pop(old)
            if (cls.__name__, old) not in _REPORTED_RENAMES:
                _REPORTED_RENAMES.add((cls.__name__, old))
                print(f"warning: trainer.{old} is deprecated and will be removed: write trainer.{new} (same meaning)")
        return data

    @model_validator(mode="after")
    def _decay_steps_need_the_cosine(self) -> TrainerConfig:
        if self.lr_decay_steps is not None and self.lr_schedule != "cosine":
            raise ValueError(f"trainer.lr_decay_steps: the length of the cosine decay, but lr_schedule is "
                             f"{self.lr_schedule!r}: set trainer.lr_schedule: cosine, or remove lr_decay_steps")
        if self.lr_warmup_start is not None and self.lr_warmup_steps == 0:
            raise ValueError("trainer.lr_warmup_start: the warm-up's first factor, but lr_warmup_steps is 0: set "
                             "trainer.lr_warmup_steps, or remove lr_warmup_start")
        return self

    @classmethod
    def former_forms(cls) -> tuple[dict[str, Any], dict[str, tuple[str, tuple[Any, ...]]]]:
        """:attr:`before` and :attr:`before_when` of this config and of every option group and config it builds
        on (an option group states its own options' former forms; the nearest class wins)."""
        before: dict[str, Any] = {}
        when: dict[str, tuple[str, tuple[Any, ...]]] = {}
        for klass in reversed(cls.__mro__):
            before.update(vars(klass).get("before", {}))
            when.update(vars(klass).get("before_when", {}))
        return before, when

    @classmethod
    def pinned_former_forms(cls, section: dict[str, Any]) -> dict[str, Any]:
        """``{key: default}`` of the :attr:`before` options that a trainer section (a recipe's ``trainer:``)
        pins to another value than today's default: what to override for the authors' forms, e.g. to check a
        recipe measured with a former form on the computation a user gets by default."""
        return {k: cls.model_fields[k].default for k in cls.former_forms()[0]
                if k in section and section[k] != cls.model_fields[k].default}

    @field_validator("betas", mode="before")
    @classmethod
    def _betas_below_one(cls, betas: Any) -> Any:
        numbers = isinstance(betas, (list, tuple)) and all(isinstance(b, (int, float)) for b in betas)
        if numbers and not all(0 <= b < 1 for b in betas):
            raise ValueError("each of Adam's betas must be in [0, 1), e.g. [0.9, 0.999]")
        return betas


class SampleOptions(Section):
    """A trainer's own rollouts in batches: prompts per step, batch size, sampling steps, guidance."""

    #: prompts per step on each rank
    prompts_per_step: int = Field(4, ge=1, le=MAX_BATCH)
    #: samples per rollout batch = per training batch (outputs depend on the batch size, so the two match)
    batch_size: int = Field(8, ge=1, le=MAX_BATCH)
    #: rollout steps T (evaluation uses eval.num_steps or the model's default)
    num_steps: int = Field(10, ge=2, le=MAX_SAMPLING_STEPS)
    #: CFG scale of the rollouts (None: the model's default)
    guidance_scale: float | None = Field(None, ge=0, le=MAX_GUIDANCE)


class RolloutOptions(SampleOptions):
    """The loop's group rollouts (:meth:`GroupTrainer.collect`, :meth:`GroupTrainer.sample`): each prompt
    sampled ``group_size`` times, in batches of ``batch_size`` whatever the group size."""

    group_size: int = Field(8, ge=2, le=MAX_GROUP_SIZE)


class StreamOptions(Section):
    """A streaming video trainer's own group rollouts: each prompt's stream forked into ``group_size``
    candidates at a chunk (not the loop's group batches: no ``batch_size``)."""

    #: prompts per step on each rank; each is forked group_size times
    prompts_per_step: int = Field(4, ge=1, le=MAX_BATCH)
    #: the few-step sampler's jumps per chunk (the distilled releases: 4)
    num_steps: int = Field(4, ge=1, le=16)
    #: CFG scale of the streams (None: the model's default)
    guidance_scale: float | None = Field(None, ge=0, le=MAX_GUIDANCE)
    #: G candidates per prompt
    group_size: int = Field(8, ge=2, le=MAX_GROUP_SIZE)


class AdvantageOptions(Section):
    """How the loop's scoring service turns a group's rewards into advantages (:meth:`GroupTrainer.score`)."""

    #: global_std (the Flow-GRPO default): per-prompt mean, std over the whole gathered batch
    advantage: str = Field("global_std", pattern="^(group|global_std|per_reward|gdpo|win_rate)$")
    adv_clip: float = Field(5.0, gt=0, le=MAX_COEFFICIENT)
    #: what divides ``advantage: gdpo``'s advantages, within each group and over the batch: "floor", the
    #: population std floored at 1e-6 (Flow-Factory's compute_gdpo, which the CrossTimeEdit authors train
    #: with); "unbiased", torch's unbiased std + 1e-4 (the GDPO authors' trl trainer); "population", the
    #: population std + 1e-4 (the former form). Other advantage kinds ignore it
    gdpo_std: Literal["floor", "unbiased", "population"] = "floor"

    #: a run saved before gdpo_std existed computed the former form, which differs only under advantage: gdpo
    #: (see TrainerConfig.before, before_when)
    before: ClassVar[dict[str, Any]] = {"gdpo_std": "population"}
    before_when: ClassVar[dict[str, tuple[str, tuple[Any, ...]]]] = {"gdpo_std": ("advantage", ("gdpo",))}


class InnerEpochOptions(Section):
    """Several passes over one batch."""

    inner_epochs: int = Field(1, ge=1, le=MAX_UPDATES)


class EpochOptions(InnerEpochOptions):
    """Several passes over one batch, each of several optimiser steps."""

    #: optimiser steps per pass over the batch (gradients accumulate over samples x trained steps)
    updates_per_epoch: int = Field(1, ge=1, le=MAX_UPDATES)


class ReferenceOptions(Section):
    """Where a full fine-tune's frozen reference copy lives (a trainer with a reference term)."""

    #: full fine-tuning with a reference term (e.g. flow_grpo's beta > 0) keeps a frozen copy of the
    #: transformer; true: keep it in CPU memory, moved to the GPU block by block for reference passes
    reference_offload: bool = False


class GroupTrainerConfig(TrainerConfig, RolloutOptions, AdvantageOptions):
    """A trainer learning from the loop's default batch: group rollouts, their rewards and advantages."""
