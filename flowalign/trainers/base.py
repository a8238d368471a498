"""The trainer contract and the shared training loop.

The loop owns everything around an algorithm: data (a step's prompts or pairs), rollouts, rewards,
advantages, the optimiser and its schedule, gradient averaging and clipping, EMA, evaluation, logging,
checkpoints and resume. A trainer subclasses :class:`GroupTrainer` and supplies a few named hooks:

``collect(step) -> batch``
    Everything a step learns from, computed without parameter gradients. The default is the loop's
    group batch (:class:`StepBatch`): the step's prompts, rollouts in batches of ``batch_size``, rewards
    (scored while the next batch samples) and advantages. A trainer changes how a group is rolled out
    through ``sampling(group) -> Sampling`` or wraps the default (e.g. to roll out with other weights);
    a trainer that learns from something else returns its own batch object with a ``logs`` dict.
``prepare(batch, scored) -> prepared``
    Optional: work of the update that reads no reward and no advantage (e.g. the KL reference's step
    means at the stored latents), run on the main thread once the last rollout batch is drawn, while
    its rewards are still being scored, so a slow reward hides it. ``batch`` is the :class:`StepBatch`
    before scoring (``scores`` and ``advantages`` None). Work in small pieces and return as soon as
    ``scored()`` is True: ``plan`` does whatever was not prepared, so results never depend on how much
    was (nor on the reward's speed). No collectives inside (ranks stop at different pieces; under fsdp,
    where every forward is one, prepare nothing). The return value reaches ``plan`` as
    ``batch.prepared``; the default prepares nothing (None). It runs inside ``collect``, under whatever
    ``collect`` wraps the rollouts in (e.g. swapped-in behaviour weights).
``plan(batch, generator) -> Plan``
    The optimiser steps of this batch: a list of steps, each a list of loss units (whatever the trainer's
    ``loss`` reads: a (rollout, timestep) pair, a fitting target, a micro-batch), plus logs. Work that
    cannot change across the steps (targets, reference velocities) is done here, once per batch.
    ``generator`` is the same on every rank (seeded by the run seed and the step): draw from it only
    what every rank draws alike; a choice about one rollout comes from :meth:`GroupTrainer.keyed_generator`
    keyed by the rollout's identity, as its noise is. A plan with ``global_weights`` weights each unit
    within its step over ALL ranks (e.g. divided by the step's unit count on every rank together); the
    loop then sums the ranks' gradients, so N ranks compute the single process's gradient.
``loss(batch, unit) -> (loss, info)``
    The scalar the loop backpropagates for one unit (already weighted within its step, e.g. divided by
    the step's unit count), and scalars to log (averaged over units): floats, or 0-dim tensors left on the
    device, which the loop reads back once at the end of the step (:mod:`flowalign.trainers.unit_logs`;
    a ``.item()`` per unit makes the host wait for the GPU at every unit).
``parameter_groups() -> (name, tensor) -> group``
    Optional: the trainable tensors in named groups, each a parameter group of the one AdamW; a plan's
    ``groups`` then names the group each optimiser step trains (clipped by its own norm, the other groups'
    tensors untouched), e.g. two roles of one model stepped one after the other as two optimisers would.
``finish(batch, steps) -> logs``
    After the optimiser steps of a batch (e.g. a behaviour-policy refresh, a reward refit). ``steps`` holds
    what ``loss`` logged, optimiser step by optimiser step (read back), for a decision that depends on one
    step's values rather than the batch's mean.
``state_dict() / load_state_dict(state)``
    What the trainer keeps between steps (tensors and JSON values); the loop saves it in every checkpoint
    and hands it back on resume, so resume stays bit-exact.

Hooks hand each other data only through their arguments and return values (batch fields, plan units),
never through attributes set on the trainer; ``loss`` reads its batch and unit and changes neither (work
done once per batch belongs in ``plan``, carried by the units). A trainer that needs more than the
loop's :class:`StepBatch` returns its own batch type or unit type rather than adding fields to it.

What the hooks may use from the loop: :meth:`GroupTrainer.step_indices` (a step's share of a data set on
this rank), :meth:`GroupTrainer.keyed_generator`, the collectives :meth:`GroupTrainer.gather`,
:meth:`GroupTrainer.gather_objects` and :meth:`GroupTrainer.total` (every rank calls them at the same
point; one process gets its own values back), and the scoring service: :meth:`GroupTrainer.score` (rewards
of samples the trainer generated itself, the invalid-sample guard, advantages and the reward logs, with
``reward/total`` over every rank's valid samples), :meth:`GroupTrainer.judge` (the same for scores already
computed) and :meth:`GroupTrainer.reward_gradient` (differentiable rewards). No trainer calls a reward set or
an advantage function itself; a trainer that scores nothing logs no reward.

What a trainer declares about itself, read by the loop and by ``flowalign plan`` alike: its ``Config``
(only the options it reads, assembled from :mod:`flowalign.trainers.options`), :meth:`GroupTrainer.weight_copies`
(the copies of weights it holds) and its step's footprint (:meth:`GroupTrainer.training_batch`,
:meth:`GroupTrainer.rollouts_per_step`, :meth:`GroupTrainer.keeps_velocities`,
:meth:`GroupTrainer.grads_through_unconditional`, and :meth:`GroupTrainer.step_holdings`: what a step keeps on
the device, phase by phase, stated from its own ``collect``, ``prepare`` and ``plan``). A trainer file reads top to bottom: its config, its loss
as a pure function with the formula in the docstring, then the hooks. ``docs/guide/adding-a-trainer.md``
walks through writing one.

Determinism: the prompts and every sample's noise are pure functions of ``(run.seed, step, group,
member)``, so a run resumed from a checkpoint ends at the same weights as one never interrupted, and
samples do not depend on the batch size or the rank layout. Trainers whose plan is global (Flow-GRPO,
Flash-GRPO, DiffusionNFT/OPSD, RG-OPD) also take the same optimiser steps on the same units whatever the
rank layout: N ranks × P prompts end at the weights of one process × N·P prompts (up to reduction order)
when the rollout batches are the same in both layouts (``batch_size`` divides ``group_size``, or divides
``prompts_per_step × group_size`` when all groups are sampled alike).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from flowalign import checkpoint as ckpt
from flowalign import step_metrics
from flowalign.flop_meter import FlopMeter, peak_tflops, policy_transformers
from flowalign.config import TrainConfig
from flowalign.data import PromptSet
from flowalign.errors import UserError
from flowalign.logger import RunLogger
from flowalign.parallel import strategy
from flowalign.plan_holdings import StepHoldings, loop_holdings
from flowalign.sequence_parallel import DataRanks
from flowalign.protocols import FlowPolicy
from flowalign.reward_set import RewardScores, RewardSet
from flowalign.signals import Abandoned, Terminated, abandonable, clear_stop
from flowalign.trainers import checkpointing, loop, unit_logs
from flowalign.trainers.copies import WeightCopy, keeps_reference
from flowalign.trainers.frozen_encoders import FrozenEncoder
from flowalign.trainers.options import (GroupTrainerConfig, RolloutOptions, SampleOptions, StreamOptions,
                                        TrainerConfig)
from flowalign.trainers.parts.reward_gradient import pixel_reward_gradient
from flowalign.trainers.optim import setup_optimisation
from flowalign.trainers.reference import keep_reference
from flowalign.trainers.rollouts import (
    Sampling,
    StepBatch,
    check_invalid,
    derived_seed,
    gathered_advantages,
    reward_logs,
    rollout_batches,
    sample_and_score,
    sample_slots,
)

__all__ = ["GroupTrainer", "GroupTrainerConfig", "Plan", "Sampling", "Scored", "StepBatch", "TrainerConfig", "WeightCopy",
           "derived_seed"]


@dataclass
class Plan:
    """The optimiser steps of one batch (each a list of loss units) and what planning them logged."""

    steps: list[list[Any]]
    logs: dict[str, float] = field(default_factory=dict)
    #: True: every rank has the same steps (some possibly empty here), and each unit is weighted within
    #: its step over all ranks' units; the loop sums the ranks' gradients instead of averaging them
    global_weights: bool = False
    #: the parameter group (a name of :meth:`GroupTrainer.parameter_groups`) each step trains, one entry a
    #: step, the same on every rank: that group's gradient is clipped by its own norm and only its tensors
    #: step, so a later step's forwards run on the weights the earlier ones left (e.g. one role, then
    #: another, as two optimisers would). None (or a None entry): every parameter, one clip
    groups: list[str | None] | None = None


@dataclass
class Scored:
    """What the scoring service returns: the rewards, advantages ``(N,)`` (None when not asked for) and
    the step's reward logs."""

    scores: RewardScores
    advantages: torch.Tensor | None
    logs: dict[str, float]


@dataclass(frozen=True)
class SliceUnit:
    """Samples ``index`` of a batch, weighted over the ``total`` samples of every rank."""

    index: slice
    total: int


def slice_plan(trainer: "GroupTrainer", n: int) -> Plan:
    """One optimiser step over ``n`` samples of this rank, in :class:`SliceUnit` micro-batches of ``batch_size``
    (a collective: the total counts every rank's samples)."""
    b, total = trainer.tcfg.batch_size, trainer.total(n)
    return Plan([[SliceUnit(slice(s, s + b), total) for s in range(0, n, b)]], global_weights=True)


class GroupTrainer:
    """The loop, with the group-rollout ``collect`` as the default; subclasses supply the other hooks."""

    Config: type[TrainerConfig] = GroupTrainerConfig
    #: False for trainers that learn without a reward (``rewards: []`` accepted)
    needs_rewards: bool = True
    sampler: Any = "flow_grpo"
    noise_level: float | None = None

    def __init__(self, cfg: TrainConfig, tcfg: GroupTrainerConfig, policy: FlowPolicy, rewards: Any,
                 data: PromptSet, evaluator: Any, accelerator: Any, run_dir: Path):
        self.cfg, self.tcfg, self.policy = cfg, tcfg, policy
        self.rewards, self.data, self.evaluator = rewards, data, evaluator
        self.run_dir = run_dir
        self.parallel = strategy(cfg.parallel, accelerator.num_processes, accelerator.process_index, accelerator.device)
        # the trainer's ranks are data ranks: with sequence parallelism several processes share one's samples
        self.acc = DataRanks(accelerator, self.parallel.layout) if self.parallel.layout.sequence > 1 else accelerator
        self.rank, self.world = self.parallel.layout.data_rank, self.parallel.layout.data_world
        reference = keeps_reference(self.weight_copies(cfg, tcfg))
        if reference is not None:  # copied from the starting weights, before sharding and any resume
            keep_reference(policy, self.parallel, reference.offloaded)
        # fsdp: shards before collecting; a trainer's parameter groups become the optimiser's
        self.optimisation = setup_optimisation(policy, tcfg, self.parallel, self.parameter_groups())
        self.params, self.optimizer, self.ema = (self.optimisation.params, self.optimisation.optimizer,
                                                 self.optimisation.ema)
        self.train_seconds = 0.0
        # perf/tflops_per_s and perf/mfu: the transformers' passes counted as they run, on a GPU or where the
        # config gives a peak (a CPU run pays a meta forward per input shape for a number nobody reads); with
        # sequence parallelism a rank's forward sees the whole sequence, so the count would be the world's
        self.peak_tflops = peak_tflops(accelerator.device, cfg.run.peak_tflops)
        counted = (accelerator.device.type == "cuda" or self.peak_tflops is not None) and self.parallel.layout.sequence == 1
        self.flop_meter = FlopMeter(policy_transformers(policy) if counted else [])
        #: this process's CPU seconds in training steps since start or resume (logged as time/cpu_minutes:
        #: on a shared machine wall-clock time depends on the neighbours, CPU time much less)
        self.train_cpu_seconds = 0.0
        self.logger = RunLogger(
            run_dir, enabled=accelerator.is_main_process, tensorboard=cfg.run.tensorboard, wandb=cfg.run.wandb,
            project=cfg.run.wandb_project, name=cfg.run.name, config=cfg.model_dump(mode="json"),
        )

    @property
    def step(self) -> int:
        """Training steps done (kept with the optimiser and its schedule, in :attr:`optimisation`)."""
        return self.optimisation.step

    @step.setter
    def step(self, value: int) -> None:
        self.optimisation.step = value

    @property
    def rewards(self) -> RewardSet:
        return self._rewards

    @rewards.setter
    def rewards(self, value: Any) -> None:
        self._rewards = RewardSet.of(value)

    @classmethod
    def training_batch(cls, tcfg: Any) -> int:
        """Samples one training forward takes (``flowalign plan`` sizes activations by it; CFG doubles the rows
        inside): the section's ``batch_size``, or 1 for a trainer without one."""
        return int(getattr(tcfg, "batch_size", 1))

    @classmethod
    def training_chunks(cls, tcfg: Any, checkpointed: bool) -> int | None:
        """A streaming trainer's training forward: the rows of one chunk each whose activations one loss holds at
        once (``flowalign plan`` sizes them so): all its chunk calls' rows, or with ``checkpointed`` (each call
        recomputed in the backward pass, :mod:`flowalign.trainers.parts.stream_calls`) one call's; None: whole
        samples, :meth:`training_batch` of them."""
        return None

    @classmethod
    def rollouts_per_step(cls, tcfg: Any) -> tuple[int, int, int]:
        """``(prompts, samples per prompt, sampling steps)`` of the rollouts a step holds on one rank, which
        ``flowalign plan`` counts, read from the option groups the section has: the loop's group rollouts
        (``RolloutOptions``), a streaming trainer's forks (``StreamOptions``: ``group_size`` candidates a
        prompt), a trainer's own batches of one sample per prompt (``SampleOptions``), or none (0, 0, 0:
        a trainer learning from data alone). A trainer whose own settings size its samples (FestDPO's
        ``K``) says so in an override."""
        if isinstance(tcfg, (RolloutOptions, StreamOptions)):
            return tcfg.prompts_per_step, tcfg.group_size, tcfg.num_steps
        if isinstance(tcfg, SampleOptions):
            return tcfg.prompts_per_step, 1, tcfg.num_steps
        return 0, 0, 0

    @classmethod
    def keeps_velocities(cls, tcfg: Any) -> bool:
        """Whether the rollouts store the policy's velocity at every step (``Sampling.keep_velocities``),
        which ``flowalign plan`` counts in the step's rollouts. Default: no."""
        return False

    @classmethod
    def grads_through_unconditional(cls, tcfg: Any) -> bool:
        """Whether CFG's unconditional half carries gradients in the training forward (the trainer calls the
        guided velocity itself: yes, the default); ``flowalign plan`` counts the rows that do."""
        return True

    @classmethod
    def check_config(cls, cfg: TrainConfig, tcfg: Any) -> None:
        """Refuse (``UserError``) settings this trainer cannot honour with the rest of ``cfg``, e.g. a
        reference-model term under full fine-tuning; called before the run folder is touched."""
        if cls.needs_rewards and not cfg.rewards:
            raise UserError(f"trainer.name={tcfg.name} learns from rewards: give at least one reward, e.g. "
                            "rewards='[{name: vvr}]'")

    @classmethod
    def weight_copies(cls, cfg: TrainConfig, tcfg: Any) -> list[WeightCopy]:
        """The copies of weights this trainer holds besides the policy (:mod:`flowalign.trainers.copies`),
        as ``cfg`` sets it up; the loop and ``flowalign plan`` both read this list. A ``reference`` copy
        (reference passes through ``policy.adapter_disabled()`` under full fine-tuning) is kept by the loop
        (:mod:`flowalign.trainers.reference`); the others the trainer allocates itself. Default: none."""
        return []

    @classmethod
    def frozen_encoders(cls, tcfg: Any) -> list[FrozenEncoder]:
        """The frozen image encoders this trainer loads onto the policy's device besides the rewards
        (:mod:`flowalign.trainers.frozen_encoders`), as ``tcfg`` sets it up; the trainer loads and ``flowalign
        plan`` sizes what this list names. Default: none."""
        return []

    @classmethod
    def step_holdings(cls, tcfg: Any) -> StepHoldings:
        """What a step keeps on the device per prompt, phase by phase (:mod:`flowalign.plan_holdings`): through
        the update, and at its moments of sampling and scoring; ``flowalign plan`` reads it. Default: the loop's
        ``collect``, its ``group_size`` rollouts a prompt held until the update is done, one chunk decoded while
        they are. A trainer whose ``collect`` holds more or less says so in an override."""
        return loop_holdings(cls.rollouts_per_step(tcfg)[1])

    # ------------------------------------------------------------------ hooks
    def sampling(self, group: int) -> Sampling:
        """How a prompt group is rolled out (default: the trainer's sampler on every step but the last)."""
        return Sampling(self.sampler, self.noise_level)

    def collect(self, step: int) -> Any:
        """The step's batch (default: prompts → rollouts → rewards → advantages, a :class:`StepBatch`)."""
        prompts, metadata, groups = self.step_prompts(step)
        prompt_ids = torch.tensor(self.step_indices(step)).repeat_interleave(self.tcfg.group_size)
        return self.group_batch(prompts, metadata, groups, prompt_ids, step)

    def prepare(self, batch: StepBatch, scored: Callable[[], bool]) -> Any:
        """Reward-independent work of the update, done while the last rewards are scored (default: none);
        stop once ``scored()``. The result reaches :meth:`plan` as ``batch.prepared``."""
        return None

    def plan(self, batch: Any, generator: torch.Generator) -> Plan:
        """The optimiser steps of ``batch``, each a list of units for :meth:`loss`."""
        raise NotImplementedError

    def loss(self, batch: Any, unit: Any) -> tuple[torch.Tensor, dict[str, float]]:
        """The scalar to backpropagate for ``unit`` (weighted within its step) and scalars to log."""
        raise NotImplementedError

    def filler(self, batch: Any, update: int) -> Any:
        """A unit of optimiser step ``update`` that :meth:`loss` can run on ``batch`` (its loss is multiplied
        by 0), running the same forward passes as the step's other units: under fsdp a rank with no unit
        in a step its peers train in runs these, since every forward is a collective."""
        raise NotImplementedError(f"{type(self).__name__} has no filler unit, needed by parallel.strategy=fsdp "
                                  "when a rank has nothing to train on")

    def parameter_groups(self) -> Callable[[str, torch.nn.Parameter], str] | None:
        """The name of the optimiser group of each trainable tensor (its name in ``policy.trainable``, the
        tensor), for plans whose steps each train one group (:attr:`Plan.groups`); called once, while the loop
        builds the optimiser (``self.tcfg`` and ``self.policy`` are set). Each group is a parameter group of
        the one AdamW (saved and resumed with it); default None: one group."""
        return None

    def finish(self, batch: Any, steps: list[dict[str, list[float]]]) -> dict[str, float]:
        """After the batch's optimiser steps; returns scalars to log. ``steps`` holds each optimiser step's
        logged values on this rank (key → one value a unit, as ``loss`` logged them; ``grad_norm``: the step's
        gradient norm)."""
        return {}

    def keyed_generator(self, *key: int) -> torch.Generator:
        """A generator for the current step keyed like the noise, ``(run.seed, step, *key)``: a draw about
        one rollout (key it by its group and member) is the same whichever rank or batch holds it."""
        return torch.Generator().manual_seed(derived_seed(self.cfg.run.seed, self.step, *key))

    def state_dict(self) -> dict[str, Any]:
        """What the trainer keeps between steps: tensors and JSON values, saved in every checkpoint."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (called on resume)."""

    # ------------------------------------------------------------------ for the hooks: data and collectives
    def step_indices(self, step: int, data: PromptSet | None = None, count: int | None = None) -> list[int]:
        """This rank's ``count`` items of a step (default ``prompts_per_step``) as indices into ``data``
        (default the prompts): rank r takes items ``r·count … (r+1)·count − 1`` of the step's global draw, so
        N ranks together hold what one process drawing ``N·count`` holds."""
        data = self.data if data is None else data
        n = self.tcfg.prompts_per_step if count is None else count
        return data.batch_indices(self.cfg.run.seed, step, n * self.world)[self.rank * n : (self.rank + 1) * n]

    def gather(self, values: torch.Tensor) -> torch.Tensor:
        """Every rank's ``values`` (the same shape on each) concatenated along dim 0 in rank order, on the
        CPU; ``values`` itself in one process. A collective."""
        return self.acc.gather(values.to(self.acc.device)).cpu()

    def gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's picklable ``obj``, in rank order; ``[obj]`` in one process. A collective."""
        return self.parallel.gather_objects(obj)

    def total(self, n: int) -> int:
        """``n`` summed over ranks. A collective."""
        return self.parallel.total(n)

    def reward_logs(self, scores: RewardScores) -> dict[str, float]:
        """``reward/total`` (the mean over every rank's valid samples), the per-reward means and the invalid
        fraction of this step's ``scores``: how every trainer logs its rewards. A collective."""
        return reward_logs(scores, self.acc)

    # ------------------------------------------------------------------ the loop's batch

    def step_prompts(self, step: int, data: PromptSet | None = None) -> tuple[list[str], list[dict], torch.Tensor]:
        """This rank's prompts of a step (``step_indices`` into ``data``, default the prompts), each repeated
        group_size times, with global group ids."""
        data = self.data if data is None else data
        p, g = self.tcfg.prompts_per_step, self.tcfg.group_size
        idx = self.step_indices(step)
        prompts = [data.prompts[i] for i in idx for _ in range(g)]
        metadata = [data.metadata[i] for i in idx for _ in range(g)]
        groups = torch.arange(self.rank * p, (self.rank + 1) * p).repeat_interleave(g)
        return prompts, metadata, groups

    def group_batch(self, prompts: list[str], metadata: list[dict], groups: torch.Tensor,
                    prompt_ids: torch.Tensor | None = None, step: int | None = None) -> StepBatch:
        """Rollouts of these prompts (the noise of ``step``, default the current one), their rewards and
        advantages."""
        step = self.step if step is None else step
        batch = self.sample(prompts, metadata, groups, prompt_ids, step)
        t = time.perf_counter()
        scored = self.judge(batch.scores, batch.samples, batch.prompt_ids, step)
        batch.advantages = scored.advantages
        batch.logs.update(scored.logs)
        batch.logs["time/reward"] += time.perf_counter() - t
        return batch

    # ------------------------------------------------------------------ the scoring service
    def score(self, samples: torch.Tensor, prompts: list[str], metadata: list[dict],
              prompt_ids: torch.Tensor | None = None, step: int | None = None) -> Scored:
        """Rewards of ``samples (N, C, H, W)`` or videos, checked and turned into advantages: how every
        trainer scores what it generated (a collective).

        The batch is refused when more than ``run.max_invalid_fraction`` of it is invalid; with ``prompt_ids
        (N,)`` the advantages are the trainer's ``advantage`` kind over every rank's samples, grouped by
        prompt (0 for invalid samples); without, none (e.g. a reward only watched, or used to label pairs).
        ``logs``: ``reward/total``, the per-reward means, the invalid fraction (and ``zero_adv_fraction``)."""
        t = time.perf_counter()
        scores = self.rewards.score(samples, prompts, metadata)
        scored = self.judge(scores, samples, prompt_ids, self.step if step is None else step)
        scored.logs["time/reward"] = time.perf_counter() - t
        return scored

    def judge(self, scores: RewardScores, samples: torch.Tensor, prompt_ids: torch.Tensor | None,
              step: int) -> Scored:
        """The invalid guard, advantages and reward logs of ``scores`` already computed (see :meth:`score`)."""
        check_invalid(scores, step, self.cfg.run.max_invalid_fraction, samples, self.run_dir)
        logs = self.reward_logs(scores)
        advantages = None
        if prompt_ids is not None:
            # gdpo_std is every advantage section's; a trainer's own options come on top
            options = {"gdpo_std": self.tcfg.gdpo_std, **self.advantage_options()}
            advantages = gathered_advantages(self.tcfg.advantage, scores, prompt_ids, self.acc, self.tcfg.adv_clip,
                                             **options)
            logs["zero_adv_fraction"] = (advantages == 0).float().mean().item()
        return Scored(scores, advantages, logs)

    def reward_gradient(self, prompts: list[str], metadata: list[dict],
                        decoder_checkpointing: bool = False) -> Callable[[torch.Tensor], torch.Tensor]:
        """``latents ↦ ∇ total reward`` of decoded latents for these prompts, through the VAE decoder (the
        differentiable rewards' service; see :func:`flowalign.trainers.parts.reward_gradient.pixel_reward_gradient`)."""
        return pixel_reward_gradient(self.policy, self.rewards, prompts, metadata, decoder_checkpointing)

    def non_differentiable_rewards(self) -> list[str]:
        """Names of the configured rewards that give no gradient (a reward-gradient trainer refuses them)."""
        return self.rewards.not_differentiable()

    def advantage_options(self) -> dict[str, Any]:
        """Options of ``trainer.advantage`` beyond its kind (see ``compute_advantages``); none by default."""
        return {}

    def shares_initial_noise(self) -> bool:
        """Whether every member of a prompt group starts from the group's one ``x_T`` (default: no)."""
        return False

    def rollout_slots(self, prompts: list[str], metadata: list[dict], groups: torch.Tensor,
                      prompt_ids: torch.Tensor, step: int) -> list:
        """One slot per sample (its prompt, group and noise seeds) for :meth:`sample`; a trainer whose samples
        share noise differently overrides this, not the sampling loop."""
        return sample_slots(self.policy, prompts, metadata, groups, prompt_ids, self.cfg.run.seed, step,
                            self.shares_initial_noise())

    def sample(self, prompts: list[str], metadata: list[dict], groups: torch.Tensor,
               prompt_ids: torch.Tensor | None = None, step: int | None = None) -> StepBatch:
        """Rollouts in batches of ``batch_size``, scored as they come (``scores``, ``logs`` time/*).
        ``prompt_ids`` (the prompts' data indices; default: the group ids) group the advantages."""
        prompt_ids = groups.clone() if prompt_ids is None else prompt_ids
        step = self.step if step is None else step
        slots = self.rollout_slots(prompts, metadata, groups, prompt_ids, step)
        sampling = {g: self.sampling(g) for g in dict.fromkeys(groups.tolist())}
        batches = rollout_batches(slots, sampling, self.tcfg.batch_size)
        order = [s for b in batches for s in b]
        group_ids, ids = torch.tensor([s.group for s in order]), torch.tensor([s.prompt_id for s in order])
        chunks, scores, times, prepared = sample_and_score(
            self.policy, self.rewards, batches, sampling, self.tcfg.num_steps, self.tcfg.guidance_scale,
            lambda drawn, scored: self.prepare(StepBatch(drawn, group_ids, ids), scored))
        return StepBatch(chunks, group_ids, ids, scores, logs=dict(times), prepared=prepared)

    # ------------------------------------------------------------------ one step
    def update(self, batch: Any, generator: torch.Generator) -> dict[str, float]:
        """The plan's optimiser steps: every unit's loss backpropagated, then one optimiser step each."""
        plan = self.plan(batch, generator)
        logged: list[dict[str, list[unit_logs.Logged]]] = []  # each optimiser step's unit logs
        # the optimiser step averages gradients over ranks: a global plan's weights make that a sum
        scale = self.world if plan.global_weights else 1
        # fsdp: every rank runs as many optimiser steps and forward/backward passes (each one is a collective),
        # padding with a unit of the same step (a unit's passes may depend on its step)
        groups = plan.groups or []
        for update, units in enumerate(self.parallel.padded(plan.steps, list)):
            group = groups[update] if update < len(groups) else None
            padded = self.parallel.padded(units, lambda: units[0] if units else self.filler(batch, update))
            stats: dict[str, list[unit_logs.Logged]] = {}
            for n, unit in enumerate(padded):
                loss, info = self.loss(batch, unit)
                if n >= len(units):
                    (loss * 0).backward()  # a padding pass: same collectives, no gradient
                    continue
                (loss * scale).backward()
                for key, value in info.items():  # detached: a logged tensor must not keep the unit's graph alive
                    stats.setdefault(key, []).append(value.detach() if isinstance(value, torch.Tensor) else value)
            # a one-group step keeps the plain call (the contract trainers and tests override)
            stats["grad_norm"] = [self.optimizer_step() if group is None else self.optimizer_step(group)]
            if group is not None:  # each group's own norm too (grad_norm: their mean)
                stats[f"grad_norm_{group}"] = list(stats["grad_norm"])
            logged.append(stats)
        steps = unit_logs.read_back_steps(logged)
        return {**plan.logs, **unit_logs.merged(unit_logs.concatenated(steps)), **self.finish(batch, steps)}

    def train_step(self) -> dict[str, float]:
        """collect → plan → losses and optimiser steps → finish; the step's log line."""
        t0, cpu0 = time.perf_counter(), time.process_time()
        step_metrics.begin_step(self.acc.device)  # memory/peak_gib_* are this step's peaks
        self.flop_meter.take()  # and perf/tflops_per_s this step's FLOPs (not an evaluation's before it)
        alone = self.parallel.world == 1
        with abandonable(alone):  # collecting changes no weight: SIGTERM may drop it
            rng = ckpt.rng_state() if alone else None
            try:
                batch = self.collect(self.step)
            except Abandoned:
                ckpt.restore_rng_state(*rng)  # the dropped step's draws are undone: the resumed run makes them
                raise
        t_update = time.perf_counter()
        generator = torch.Generator().manual_seed(derived_seed(self.cfg.run.seed, self.step, 1))  # every rank's
        stats = self.update(batch, generator)
        now, cpu = time.perf_counter(), time.process_time() - cpu0
        self.train_cpu_seconds += cpu
        return {**batch.logs, "time/update": now - t_update, "time/step": now - t0, "time/step_cpu": cpu,
                "time/cpu_minutes": self.train_cpu_seconds / 60, **{f"train/{k}": v for k, v in stats.items()},
                **step_metrics.step_logs(self.acc.device, now - t0, step_metrics.generated_samples(batch),
                                         self.flop_meter.take(), self.peak_tflops)}

    def optimizer_step(self, group: str | None = None) -> torch.Tensor:
        """Average gradients over ranks, clip, step, update the EMA (``group``: that parameter group alone,
        clipped by its own norm). Returns the pre-clip norm (0-dim, on the device:
        :mod:`flowalign.trainers.unit_logs` reads it back with the step's other logs)."""
        return self.optimisation.optimizer_step(group)

    def budget_fraction(self) -> float:
        """How much of the run's budget is spent, in [0, 1]: steps, or training minutes (slowest rank)."""
        fraction = self.step / self.tcfg.max_steps
        if self.tcfg.max_minutes is not None:
            fraction = max(fraction, self.slowest_train_seconds() / (60 * self.tcfg.max_minutes))
        return min(1.0, fraction)

    def out_of_time(self) -> bool:
        """Whether the training-time budget is spent (the slowest rank decides, so all ranks stop together)."""
        limit = self.tcfg.max_minutes
        return limit is not None and self.slowest_train_seconds() >= limit * 60

    def slowest_train_seconds(self) -> float:
        seconds = torch.tensor([self.train_seconds], device=self.acc.device)
        if self.parallel.world > 1:  # every process, sequence ranks too: they must stop at the same step
            seconds = self.acc.reduce(seconds, reduction="max")
        return float(seconds)

    # ------------------------------------------------------------------ run, evaluate, checkpoints
    def train(self) -> dict[str, Any]:
        """Run until ``trainer.max_steps`` (see :func:`flowalign.trainers.loop.run`). A SIGTERM that came
        while a step's rewards or an evaluation were awaited drops that work (:mod:`flowalign.signals`):
        the last completed step is saved, then :class:`flowalign.signals.Terminated` says where."""
        try:
            return loop.run(self)
        except Abandoned as e:
            raise Terminated(self._save_abandoned(e.reward)) from None
        finally:
            clear_stop()

    def _save_abandoned(self, reward: str) -> str:
        """Save the last completed step unless its checkpoint is on disk; the line saying where it is."""
        newest = ckpt.latest_checkpoint(self.run_dir)
        saved = newest if newest is not None and newest.name == ckpt.step_dir_name(self.step) else None
        where = saved or self.save_checkpoint()
        return (f"SIGTERM received; saved {where} at step {self.step} (rerun the same command to resume; the work "
                f"in flight, waiting for reward {reward!r}, was dropped)")

    def evaluate(self) -> dict[str, Any]:
        with abandonable(self.parallel.world == 1):  # an evaluation changes no weight: SIGTERM may drop it
            return loop.evaluate(self)

    def trainable_state(self) -> dict[str, torch.Tensor]:
        """The trainable weights by name, plus the trainer's state tensors (checkpoint prefix)."""
        weights = {n: p for n, p in self.policy.trainable.named_parameters() if p.requires_grad}
        own, _ = checkpointing.split_state(self.state_dict())
        return {**weights, **own}

    def save_checkpoint(self) -> Path:
        return checkpointing.save(self)

    def maybe_resume(self) -> None:
        checkpointing.resume(self)

    def rank_checksums(self) -> list[float]:
        """Sum of the trainable weights on every process (sequence ranks too); processes that diverged are an
        error, not a warning."""
        sums = self.parallel.every_process(float(self.parallel.checksum(self.params)))
        if len(set(sums)) > 1:
            raise RuntimeError(f"step {self.step}: ranks hold different weights (checksums {sums})")
        return sums
