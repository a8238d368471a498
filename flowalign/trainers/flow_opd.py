"""Flow-OPD: on-policy distillation of several single-reward teachers into one student
(``docs/methods/flow_opd.md``).

Stage 1 trains one teacher per reward with any single-reward trainer (their run folders' checkpoints are
the teachers). Stage 2, this trainer, gives each prompt a teacher (``routing``,
:mod:`flowalign.trainers.parts.teacher_routing`): ``by_epoch`` (the authors') alternates whole steps between
the teachers, ``teachers[i].epochs_per_cycle`` steps each in turn, a step's prompts all drawn from its
teacher's own source (its ``prompts`` file, or its domain of the data); ``by_prompt`` sends each prompt to the
teacher of its domain (``teachers[i].match``, a regular expression; the first match wins). A step's prompts are
drawn as the authors' sampler draws them (``prompt_draw: per_batch``, :mod:`flowalign.trainers.parts.prompt_draws`):
fresh draws of ``prompts_per_draw`` distinct prompts, independent of every other draw. It trains the student on
its own rollouts by one of two objectives (``objective``):

- ``kl_reward_grpo`` (default; the authors' ``train_sd3_opd_mix.py``, ``reward_mode: kl_only``): Flow-GRPO
  on the student's SDE rollouts with the step-wise KL to the routed teacher as the only reward. At each
  trained step k, with ``μ``, ``μ_T`` the student's and the teacher's Gaussian step means at the stored
  ``x_k`` and ``s`` the step's diffusion coefficient,

      KL_i = mean_D (μ_i − μ_T,i)² / (2·s²)         (μ_i with its gradient: the advantage is not detached)
      A_i  = clip(kl_scale·KL_i, −adv_clip, adv_clip)   (kl_scale −1: the negative KL)
      L    = mean_{i,j} max(−A_i·r_j, −A_i·clip(r_j, 1−ε, 1+ε)) + β·mean_i KL(μ_i ‖ μ_anchor,i)

  with ``r_j = exp(ℓ_j(θ) − ℓ_j(θ_old))``. The double mean is the authors' code: its advantages are
  ``(B, 1)`` and its ratios ``(B,)``, so every advantage meets every ratio of the micro-batch
  (``advantage_pairing: sample`` pairs each sample with its own ratio). The β term's anchor is ``anchor``
  (the authors' ``mar_lora``) or the starting weights.
- ``velocity_distillation``: a flow-matching cold start on the teachers' samples (``cold_start_steps``),
  then regression of the student's velocity on the routed teacher's at the student's ODE states, with a
  task-agnostic anchor on every prompt:

      L_i = 1[i routed] · mean_k ‖v_θ(x_k) − v_T(i)(x_k)‖² + λ · mean_k ‖v_θ(x_k) − v_A(x_k)‖²

  with ``λ = anchor_weight`` and both targets detached (teacher weights swapped in, no gradient); its batch,
  states and loss: :mod:`flowalign.trainers.parts.teacher_distillation`.
"""

from __future__ import annotations

import dataclasses
import re
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from flowalign.config import changed
from flowalign.data import PromptSet
from flowalign.errors import UserError
from flowalign.limits import MAX_COEFFICIENT, MAX_GROUP_SIZE, MAX_SAMPLING_STEPS, MAX_TRAIN_STEPS, MAX_UPDATES
from flowalign.plan_holdings import Holding, StepHoldings, loop_holdings
from flowalign.protocols import Conditioning
from flowalign.sampling import Rollout
from flowalign.trainers.base import Plan, Sampling, SliceUnit, StepBatch, derived_seed, slice_plan
from flowalign.trainers.copies import WeightCopy, full_reference
from flowalign.trainers.flow_grpo import (FlowGRPOBase, FlowGRPOTrainer, SDEOptions, SDEWindowOptions,
                                           StepFractionOptions, StepSubsetOptions, StepUnit, coded_kl_gap,
                                           gaussian_mean_kl)
from flowalign.trainers.options import ReferenceOptions, SampleOptions, TrainerConfig
from flowalign.trainers.parts.global_plan import ChunkRef, global_plan
from flowalign.trainers.parts.policy_gradient import ppo_clip_loss
from flowalign.trainers.parts.prompt_draws import per_batch_draw
from flowalign.trainers.parts.regrouped_micro_batches import Regrouped, inner_epoch_micro_batches
from flowalign.trainers.parts.sample_parts import sample_keys
from flowalign.trainers.parts.teacher_distillation import (DistillBatch, cold_start_batch, drawn_states,
                                                            states_loss)
from flowalign.trainers.parts.teacher_routing import epoch_teacher, route, teacher_epoch, teacher_sources
from flowalign.trainers.parts.teacher_weights import check_merge, merge_into, read_weights
from flowalign.trainers.rollouts import roll_out, rollout_batches, sample_slots
from flowalign.weight_swap import swapped_in


class Teacher(BaseModel):
    model_config = ConfigDict(extra="forbid")
    #: a stage-1 run folder (its newest whole checkpoint), one of its checkpoints/step-N, or a saved adapter
    adapter: str
    #: the reward this teacher was trained on (a name in rewards:; the domain's score is logged under it)
    reward: str | None = None
    #: its domain: the prompts this regular expression finds (re.search) and no earlier teacher's does; None:
    #: every prompt left
    match: str | None = None
    #: routing: by_epoch: a prompt file (read as data.prompts) its steps draw from (the authors' dataset path);
    #: None: its domain of data.prompts (a teacher with a file takes no data prompt)
    prompts: str | None = None
    #: routing: by_epoch: how many consecutive steps (the authors' epochs) it takes in each cycle (their
    #: epochs_per_cycle)
    epochs_per_cycle: int = Field(1, ge=1, le=MAX_TRAIN_STEPS)


#: the options only ``objective: velocity_distillation`` reads
DISTILLATION_ONLY = frozenset({"anchor_weight", "states_per_sample"})
#: the options both objectives read: the loop's, the rollouts' sizes, the teachers, the anchor, the cold start
BOTH_READ = frozenset(TrainerConfig.model_fields) | frozenset(SampleOptions.model_fields) | {
    "objective", "teachers", "routing", "anchor", "cold_start_steps", "merge_teachers", "merge_weights", "group_size",
    "reference_offload", "prompt_draw", "prompts_per_draw"}


class FlowOPDConfig(FlowGRPOBase, ReferenceOptions, SDEOptions, SDEWindowOptions, StepFractionOptions,
                    StepSubsetOptions):
    """Flow-GRPO's options (read by ``kl_reward_grpo``) and the distillation's; see the module docstring."""

    name: Literal["flow_opd"] = "flow_opd"  # type: ignore[assignment]
    #: what runs saved before these options existed computed (see TrainerConfig.before)
    before = {"objective": "velocity_distillation", "prompt_draw": "per_pass", "micro_batches": "in_order",
              "shuffle_draw": "per_step"}
    #: shuffle_draw's former form differs only with several inner epochs (one inner epoch trains the step's
    #: first permutation either way)
    before_when = {"shuffle_draw": ("inner_epochs", tuple(range(2, MAX_UPDATES + 1)))}
    #: kl_reward_grpo: Flow-GRPO with the step-wise KL to the routed teacher as the reward (the authors'
    #: rule); velocity_distillation: regression on the teachers' velocities (cold start, anchor term)
    objective: Literal["kl_reward_grpo", "velocity_distillation"] = "kl_reward_grpo"
    #: the stage-1 teachers, each supervising its own domain's prompts
    teachers: list[Teacher] = Field(min_length=1)
    #: by_epoch: whole steps alternate between the teachers in list order, epochs_per_cycle steps each, every
    #: prompt of a step from its teacher's source (the authors' alternate training); by_prompt: each prompt
    #: of the data goes to the first teacher whose match finds it, so a step mixes domains
    routing: Literal["by_epoch", "by_prompt"] = "by_epoch"
    #: how a step's prompts are drawn from its source: per_batch (the authors' DistributedKRepeatSampler): fresh
    #: draws of prompts_per_draw distinct prompts each, independent of every other (a prompt may come again in
    #: the next draw); per_pass: passes through a permutation of the source, no repeat within a pass
    prompt_draw: Literal["per_batch", "per_pass"] = "per_batch"
    #: prompt_draw: per_batch: prompts a draw (the authors' GPUs × sample.train_batch_size / num_image_per_prompt:
    #: 8 × 4 / 16 = 2 in mix_opd_8gpu)
    prompts_per_draw: int = Field(2, ge=1, le=MAX_GROUP_SIZE)
    #: the anchor: a checkpoint folder, or None for the starting weights. kl_reward_grpo: the β term's
    #: reference (the authors' mar_lora); velocity_distillation: the Manifold Anchor Regularisation teacher
    anchor: str | None = None
    #: kl_reward_grpo: the advantage is kl_scale·KL (the authors' −1: the reward is the negative KL)
    kl_scale: float = Field(-1.0, ge=-MAX_COEFFICIENT, le=MAX_COEFFICIENT)
    #: kl_reward_grpo: "batch" pairs every advantage with every ratio of the chunk (the authors' code: (B, 1)
    #: advantages broadcast against (B,) ratios); "sample" pairs each sample with its own ratio
    advantage_pairing: Literal["batch", "sample"] = "batch"
    #: kl_reward_grpo: which samples form a micro-batch (the rollout chunk of batch_size the pairing runs
    #: over): "shuffled" (the authors': each rank's samples of the step permuted, then cut into micro-batches;
    #: the permutation keyed by (seed, step, rank)); "in_order": the prompts' order, a group's samples together
    micro_batches: Literal["shuffled", "in_order"] = "shuffled"
    #: kl_reward_grpo, micro_batches: shuffled: when the permutation is drawn. "per_inner_epoch" (the authors':
    #: each inner epoch permutes the previous one's order again, keyed by (seed, step, rank, inner epoch), and
    #: cuts new micro-batches from it); "per_step": one permutation a step, every inner epoch training the first
    #: one's micro-batches again (the former form). The same with inner_epochs: 1
    shuffle_draw: Literal["per_inner_epoch", "per_step"] = "per_inner_epoch"
    #: kl_reward_grpo: leave out the samples whose task advantage (rewards:, grouped by prompt) is 0, as the
    #: authors' code does before batching (there each dataset has its own reward; here the run's rewards
    #: score every prompt, so it is off unless they are the domains' own)
    drop_zero_advantage: bool = False
    #: the authors' OPD script backpropagates through both CFG branches
    cfg_grad: Literal["detached", "full"] = "full"
    #: the rollouts' SDE (the authors': Flow-GRPO's, a = 0.7)
    sampler: Literal["flow_grpo"] = "flow_grpo"  # type: ignore[assignment]
    #: student rollouts per prompt (the authors' 16; kl_reward_grpo takes no group statistics unless
    #: drop_zero_advantage)
    group_size: int = Field(16, ge=1, le=MAX_GROUP_SIZE)
    #: steps of the flow-based cold start (flow matching on the teachers' samples) before the objective's
    #: training; None: 20 under velocity_distillation, 0 under kl_reward_grpo (the authors' cold start is a
    #: merge of the teachers' adapters before training, not a training stage: merge_teachers)
    cold_start_steps: int | None = Field(None, ge=0, le=MAX_TRAIN_STEPS)
    #: start the student from the teachers' trained tensors merged tensor by tensor (the authors'
    #: scripts/merge.py, whose result their train.lora_path loads): "average", "sum", or "weighted" by
    #: merge_weights (normalised to sum 1); None: the fresh adapter (their mix_opd_8gpu sets no lora_path)
    merge_teachers: Literal["average", "sum", "weighted"] | None = None
    #: merge_teachers: weighted: one weight per teacher, in list order
    merge_weights: list[Annotated[float, Field(ge=0, le=MAX_COEFFICIENT)]] | None = Field(None, max_length=MAX_GROUP_SIZE)
    #: velocity_distillation: λ, the anchor term's weight on every prompt (0: no anchor)
    anchor_weight: float = Field(0.1, ge=0, le=MAX_COEFFICIENT)
    #: velocity_distillation: visited states trained per rollout (drawn at random per sample and step);
    #: None: all num_steps
    states_per_sample: int | None = Field(None, ge=1, le=MAX_SAMPLING_STEPS)


def report_unread(tcfg: FlowOPDConfig, unread: set[str], objective: str) -> None:
    """One warning line naming the options set in the config that ``objective`` does not read."""
    if unread:
        print(f"warning: objective: {objective} does not read trainer.{', trainer.'.join(sorted(unread))} "
              "(set for the other objective); drop them or change trainer.objective")


# ---------------------------------------------------------------------------------------------- the loss


@dataclass
class KLRewardLoss:
    """:func:`kl_reward_grpo_loss`'s result: the scalar ``loss``, and per sample ``kl (B,)`` (with its gradient),
    ``advantages (B,)``, ``ratio (B,)`` and the clipped flags (``(B, B)`` under batch pairing, else ``(B,)``)."""

    loss: torch.Tensor
    kl: torch.Tensor
    advantages: torch.Tensor
    ratio: torch.Tensor
    clipped: torch.Tensor


def kl_reward_grpo_loss(log_prob: torch.Tensor, old_log_prob: torch.Tensor, mean: torch.Tensor,
                        teacher_mean: torch.Tensor, std: torch.Tensor, sigma_gap: float, *, kl_scale: float,
                        adv_clip: float, clip_range: float, pairing: str = "batch",
                        kl_mode: str = "code") -> KLRewardLoss:
    """The authors' clipped surrogate with the step-wise KL to the teacher as the advantage, one step of ``B``
    samples: log-probs ``(B,)``, step means ``(B, ...)``, the step's std ``τ`` broadcastable to them.

        KL_i = mean_D (μ_i − μ_T,i)²/(2s²)  (s² = τ²/sigma_gap; kl_mode "exact": Σ_D (μ_i − μ_T,i)²/(2τ²))
        A_i  = clip(kl_scale·KL_i, ±adv_clip)                        (not detached: KL carries μ's gradient)
        L    = mean_{i,j} max(−A_i·r_j, −A_i·clip(r_j, 1±ε))  (pairing "batch"; "sample": mean_i with r_i)
    """
    kl = gaussian_mean_kl(mean, teacher_mean, std, sigma_gap, kl_mode)
    adv = (kl_scale * kl).clamp(-adv_clip, adv_clip)
    # "batch": the authors' (B, 1) advantages against (B,) ratios, an outer (B, B) surrogate
    surrogate, ratio, clipped = ppo_clip_loss(log_prob, old_log_prob, adv[:, None] if pairing == "batch" else adv,
                                              clip_range)
    return KLRewardLoss(surrogate.mean(), kl, adv, ratio, clipped)


# ---------------------------------------------------------------------------------------------- hooks


@dataclass(frozen=True)
class TeacherUnit(StepUnit):
    """A Flow-GRPO unit with what the KL reward reads, computed once per batch: which of the chunk's samples
    are trained ``trained (B,)`` bool and the routed teachers' step means ``teacher (B, ...)`` (None: the loss
    computes them, as under fsdp, where every forward is a collective)."""

    trained: torch.Tensor | None = field(default=None, compare=False)
    teacher: torch.Tensor | None = field(default=None, compare=False)
    #: an inner epoch's micro-batch re-formed from the step's samples (``shuffle_draw: per_inner_epoch``): its
    #: rows of this rank's step batch, in batch order, read through ``regrouped`` (``chunk`` is then the
    #: micro-batch's place in its epoch, and ``teacher``, ``reference`` are None: ``regrouped`` holds them);
    #: None: rollout chunk ``chunk``
    rows: tuple[int, ...] | None = None
    regrouped: Regrouped | None = field(default=None, compare=False)


class FlowOPDTrainer(FlowGRPOTrainer):
    """A preset of Flow-GRPO whose advantage is the KL to the routed teacher, or (``velocity_distillation``,
    and any cold start) the distillation hooks on a :class:`DistillBatch`."""

    Config = FlowOPDConfig
    tcfg: FlowOPDConfig
    needs_rewards = False

    @classmethod
    def distils(cls, tcfg) -> bool:
        return tcfg.objective == "velocity_distillation"

    @classmethod
    def grads_through_unconditional(cls, tcfg) -> bool:
        return True if cls.distils(tcfg) else super().grads_through_unconditional(tcfg)

    @classmethod
    def weight_copies(cls, cfg, tcfg) -> list[WeightCopy]:
        """The teachers (each a copy of the trained tensors, read from its checkpoint), and the anchor: a
        checkpoint's copy likewise, or the starting weights (a full fine-tune keeps them frozen, when read:
        always by the distillation, by kl_reward_grpo when β > 0)."""
        teachers = [WeightCopy("teacher", count=len(tcfg.teachers))]
        if tcfg.anchor is not None:
            return teachers + [WeightCopy("teacher")]
        anchored = cls.distils(tcfg) or tcfg.beta > 0
        return teachers + (full_reference(tcfg) if anchored and cfg.model.finetune == "full" else [])

    @classmethod
    def step_holdings(cls, tcfg: FlowOPDConfig) -> StepHoldings:
        """What a step holds per prompt (:mod:`flowalign.plan_holdings`).

        kl_reward_grpo: the loop's ``group_size`` rollouts and, per sample and trained step
        (:meth:`reference_steps`), the routed teacher's step mean (:meth:`plan`, whatever ``beta``) and with
        ``beta > 0`` the reference's, float32 latents kept through the update (none under fsdp, where the loss
        computes both); the teachers' are computed with their weights swapped in (the live copy kept
        meanwhile) beside the rollouts and the means. Where inner epochs re-form the micro-batches
        (:meth:`reshuffles`), one of them (``batch_size`` samples' trajectories, gathered from the chunks) is
        held beside them. velocity_distillation (and a cold start): no step means; the rollouts (ODE,
        ``group_size`` a prompt, decoded one chunk at a time) live only inside :meth:`collect`, beside the
        prompts' conditionings, their ``T`` visited states concatenated, and the
        :class:`DistillBatch` being filled (its states ``x``, the teachers' and, with ``anchor_weight > 0``, the
        anchor's velocities there, ``S = states_per_sample`` a sample), the teachers' passes under their swapped-in
        weights and the rewards scored on the concatenated decoded samples; the update keeps the batch alone."""
        g, t = tcfg.group_size, tcfg.num_steps
        if cls.distils(tcfg):
            s = min(tcfg.states_per_sample or t, t)
            batch = g * s * (2 + (tcfg.anchor_weight > 0))  # x, v_teacher, v_anchor: (B, S, ...) each
            held = Holding(latents=batch, conditionings=g)
            visited = Holding(rollouts=g, conditionings=g, latents=g * t + batch, swapping=True)
            scoring = Holding(rollouts=g, conditionings=g, latents=g * t + batch, decoded=g)
            return StepHoldings(held, (Holding(rollouts=g, conditionings=g, decoding=True), visited, scoring))
        base = loop_holdings(g)
        means = g * cls.reference_steps(tcfg) * (1 + (tcfg.beta > 0))  # the teachers' and the reference's
        held = Holding(rollouts=g, means=means)
        if cls.reshuffles(tcfg):
            # a re-formed micro-batch's trajectories, gathered for its units (one at a time): batch_size of the
            # step's samples, counted per prompt (its decoded samples too, which it leaves out: an upper bound)
            held = Holding(rollouts=g + min(tcfg.batch_size, g * tcfg.prompts_per_step) / tcfg.prompts_per_step,
                           means=means)
        return StepHoldings(held,
                            (*base.moments, Holding(rollouts=g, means=means, swapping=True)))

    @classmethod
    def check_config(cls, cfg, tcfg) -> None:
        super().check_config(cfg, tcfg)
        check_merge(tcfg.merge_teachers, tcfg.merge_weights, len(tcfg.teachers))
        names = [r.key for r in cfg.rewards]
        for i, t in enumerate(tcfg.teachers):
            if t.reward is not None and t.reward not in names:
                raise UserError(f"trainer.teachers[{i}].reward={t.reward!r} is not one of the run's rewards "
                                f"({', '.join(names) or 'none'}); add it to rewards: (weight 0 logs it only) or drop it")
            if t.match is not None:
                try:
                    re.compile(t.match)
                except re.error as e:
                    raise UserError(f"trainer.teachers[{i}].match={t.match!r} is not a regular expression ({e})")
            unread = sorted(k for k in ("prompts", "epochs_per_cycle") if changed(t, k))
            if tcfg.routing == "by_prompt" and unread:
                raise UserError(f"trainer.teachers[{i}].{unread[0]} is read only under trainer.routing: by_epoch "
                                "(by_prompt routes data.prompts by match); drop it or set routing: by_epoch")
            if tcfg.routing == "by_epoch" and t.prompts is not None and t.match is not None:
                print(f"warning: trainer.teachers[{i}].match is not read: under routing: by_epoch a teacher with "
                      "its own prompts: file takes no prompt of data.prompts; drop the match or the file")
        if cls.distils(tcfg):
            report_unread(tcfg, {k for k in tcfg.model_fields_set if changed(tcfg, k)} - BOTH_READ - DISTILLATION_ONLY,
                          "velocity_distillation")
            return
        report_unread(tcfg, {k for k in DISTILLATION_ONLY if changed(tcfg, k)}, "kl_reward_grpo")
        if tcfg.micro_batches == "in_order" and changed(tcfg, "shuffle_draw"):
            print("warning: trainer.shuffle_draw is not read under trainer.micro_batches: in_order (every inner epoch "
                  "trains the same micro-batches); drop it or set micro_batches: shuffled")
        if tcfg.kl_scale == 0:
            raise UserError("trainer.kl_scale=0 makes every advantage 0 (nothing trains); the authors' value is -1")
        if tcfg.drop_zero_advantage and (tcfg.group_size < 2 or not any(r.weight for r in cfg.rewards)):
            raise UserError("trainer.drop_zero_advantage needs task advantages: a reward with a non-zero weight in "
                            "rewards: and trainer.group_size >= 2; give them or set drop_zero_advantage: false")

    def __init__(self, cfg, tcfg, policy, *args: Any, **kw: Any):
        # the teachers' weights are read into the unsharded policy, before the loop shards it
        named = {n: p for n, p in policy.trainable.named_parameters() if p.requires_grad}
        teachers = [read_weights(policy, named, t.adapter, f"trainer.teachers[{i}].adapter")
                    for i, t in enumerate(tcfg.teachers)]
        anchor = read_weights(policy, named, tcfg.anchor, "trainer.anchor") if tcfg.anchor else None
        if tcfg.merge_teachers is not None:  # before the loop copies the weights (EMA) and shards them
            merge_into(named, teachers, tcfg.merge_teachers, tcfg.merge_weights)
        super().__init__(cfg, tcfg, policy, *args, **kw)
        names = [n for n, p in self.policy.trainable.named_parameters() if p.requires_grad]
        if len(names) != len(self.params):
            raise RuntimeError("the trainable parameters changed while the loop set up")
        place = self.parallel.place
        self.teachers = [[place(t[n], p) for n, p in zip(names, self.params)] for t in teachers]
        self.anchor = None if anchor is None else [place(anchor[n], p) for n, p in zip(names, self.params)]
        self.patterns = [t.match for t in tcfg.teachers]
        if tcfg.routing == "by_epoch":  # each teacher's prompts: its file, or its domain of the data
            self.sources = teacher_sources(self.data, [t.prompts for t in tcfg.teachers], self.patterns)
            self.shares = [t.epochs_per_cycle for t in tcfg.teachers]
            return
        # a teacher no training prompt is routed to (its match finds none, or an earlier teacher takes them
        # all) would sit in memory unused: say so before training
        routed = set(route(self.data.prompts, self.patterns).tolist())
        for i, t in enumerate(tcfg.teachers):
            if i not in routed and self.acc.is_main_process:
                print(f"warning: trainer.teachers[{i}] ({t.adapter}, match={t.match!r}) is the first match of none "
                      f"of the {len(self.data.prompts)} training prompts, so it is never used; fix its match (a "
                      "regular expression searched in each prompt) or its place in the list, or drop it")

    @property
    def cold_start_steps(self) -> int:
        """The cold start's length: as set, or by default 20 under velocity_distillation and 0 under
        kl_reward_grpo."""
        n = self.tcfg.cold_start_steps
        return (20 if self.distils(self.tcfg) else 0) if n is None else n

    def routed(self, prompts: list[str], step: int) -> torch.Tensor:
        """``(N,)`` each prompt's teacher at ``step`` (−1: none): the step's teacher under by_epoch, else the
        first teacher whose match finds it."""
        if self.tcfg.routing == "by_epoch":
            return torch.full((len(prompts),), epoch_teacher(step, self.shares), dtype=torch.long)
        return route(prompts, self.patterns)

    def step_indices(self, step: int, data: PromptSet | None = None, count: int | None = None) -> list[int]:
        """Under by_epoch, a step's prompts are indices into its teacher's source, else into the data.
        ``prompt_draw: per_batch``: the step's global ``count × world`` prompts from fresh draws of
        ``prompts_per_draw`` (:func:`per_batch_draw`), draw b keyed by (seed, step, b), rank r taking its slice,
        so any rank layout and a resumed run draw the same (the authors' sampler: their generator seeded
        42 + set_epoch per batch). ``per_pass``: the loop's passes through a permutation, by_epoch's teacher
        walking through its source at its own pace (its ``teacher_epoch``-th draw)."""
        if data is not None:
            return super().step_indices(step, data, count)
        by_epoch = self.tcfg.routing == "by_epoch"
        source = self.sources[epoch_teacher(step, self.shares)] if by_epoch else self.data
        if self.tcfg.prompt_draw == "per_batch":
            n = self.tcfg.prompts_per_step if count is None else count
            seed = self.cfg.run.seed
            drawn = per_batch_draw(len(source.prompts), n * self.world, self.tcfg.prompts_per_draw,
                                   lambda b: torch.Generator().manual_seed(derived_seed(seed, step, b, 101)))
            return drawn[self.rank * n : (self.rank + 1) * n]
        return super().step_indices(teacher_epoch(step, self.shares) if by_epoch else step, source, count)

    def step_prompts(self, step: int, data: PromptSet | None = None) -> tuple[list[str], list[dict], torch.Tensor]:
        """The loop's, read from the step's teacher's source under by_epoch (where ``step_indices`` point)."""
        if data is None and self.tcfg.routing != "by_prompt":
            data = self.sources[epoch_teacher(step, self.shares)]
        return super().step_prompts(step, data)

    def anchor_weights(self):
        """The anchor's velocity context: its weights swapped in, or the adapter switched off."""
        if self.anchor is not None:
            return swapped_in(self.params, self.anchor)
        return self.policy.adapter_disabled()

    def collect(self, step: int) -> StepBatch | DistillBatch:
        """kl_reward_grpo: the loop's group batch (its task advantages only say which samples
        ``drop_zero_advantage`` leaves out) with the routing logged; the distillation and any cold start: a
        :class:`DistillBatch`."""
        if self.distils(self.tcfg) or step < self.cold_start_steps:
            return self.distill_batch(step)
        if len(self.rewards):
            batch = super().collect(step)
        else:  # nothing to score: the rollouts alone
            prompts, metadata, groups = self.step_prompts(step)
            prompt_ids = torch.tensor(self.step_indices(step)).repeat_interleave(self.tcfg.group_size)
            batch = self.sample(prompts, metadata, groups, prompt_ids, step)
        routed_to = self.routed(batch.prompts, step)
        batch.logs.update(self.route_logs(routed_to), stage=1.0)
        if batch.scores is not None and len(self.rewards):
            batch.logs.update(self.domain_logs(batch.scores, routed_to))
        return batch

    def rollout_slots(self, prompts: list[str], metadata: list[dict], groups: torch.Tensor,
                      prompt_ids: torch.Tensor, step: int) -> list:
        """The loop's slots, under ``micro_batches: shuffled`` in a keyed random order: the rollout chunks cut
        from them are then the authors' micro-batches of the first inner epoch (their ``torch.randperm`` of a
        rank's samples, reshaped into ``train_batch_size`` rows; later inner epochs re-form their own, see
        :meth:`reshuffled_plan`), and :func:`kl_reward_grpo_loss` pairs each chunk's advantages and
        ratios. A sample's noise is keyed by its group and member, so the order changes no sample."""
        slots = super().rollout_slots(prompts, metadata, groups, prompt_ids, step)
        if self.tcfg.micro_batches == "in_order":
            return slots
        perm = torch.randperm(len(slots), generator=torch.Generator().manual_seed(
            derived_seed(self.cfg.run.seed, step, self.rank, 103)))
        return [slots[i] for i in perm.tolist()]

    def route_logs(self, routed_to: torch.Tensor) -> dict[str, float]:
        return {f"route/teacher{i}_fraction": (routed_to == i).float().mean().item()
                for i in range(len(self.tcfg.teachers))}

    def trained(self, batch: StepBatch) -> torch.Tensor:
        """``(N,)`` bool: the samples a teacher is routed to (and, with ``drop_zero_advantage``, whose task
        advantage is not 0)."""
        keep = self.routed(batch.prompts, self.step) >= 0
        if self.tcfg.drop_zero_advantage:
            keep &= batch.advantages.cpu() != 0
        return keep

    def teacher_mean(self, chunk: Rollout, k: int) -> torch.Tensor:
        """``μ_T`` ``(B, ...)``: each sample's step mean at the rollout's ``x_k`` under its routed teacher's
        weights (CFG at the rollout's scale), no grad; zeros where no teacher is routed. Each teacher runs on
        the whole chunk, then its rows are kept; under fsdp all ranks must run as many forwards, so by_prompt
        runs every teacher there (ranks route differently), by_epoch the step's one (the same on every rank)."""
        routed_to = self.routed(chunk.prompts, self.step)
        x_k, sigma = chunk.step(k)[0], chunk.sigmas[k].item()
        out = torch.zeros_like(x_k)
        every = self.parallel.sharded and self.tcfg.routing == "by_prompt"
        wanted = range(len(self.teachers)) if every else sorted(set(routed_to.tolist()) - {-1})
        for i in wanted:
            with torch.no_grad(), swapped_in(self.params, self.teachers[i]):
                v = self.policy.velocity(x_k, sigma, chunk.cond, chunk.guidance_scale)
                mean = self.step_distribution(chunk, k, v).mean
            rows = (routed_to == i).to(x_k.device)
            out[rows] = mean[rows].to(out)
        return out

    def reference_mean(self, chunk: Rollout, k: int) -> torch.Tensor:
        """The β term's ``μ_anchor``: the anchor checkpoint's step mean (the authors' mar_lora), or Flow-GRPO's
        reference (the starting weights)."""
        if self.anchor is None:
            return super().reference_mean(chunk, k)
        x_k = chunk.step(k)[0]
        with torch.no_grad(), swapped_in(self.params, self.anchor):
            v = self.policy.velocity(x_k, chunk.sigmas[k].item(), chunk.cond, chunk.guidance_scale)
            return self.step_distribution(chunk, k, v).mean

    def plan(self, batch: StepBatch | DistillBatch, generator: torch.Generator) -> Plan:
        """The distillation: one optimiser step over every sample. kl_reward_grpo: Flow-GRPO's global plan over
        the chunks with a trained sample, each unit carrying the trained mask and (unsharded) the teachers'
        step means, computed once per (chunk, step); where inner epochs re-form the micro-batches
        (:meth:`reshuffles`), :meth:`reshuffled_plan`."""
        if isinstance(batch, DistillBatch):
            return slice_plan(self, len(batch.x))
        trained = self.trained(batch)
        if self.reshuffles(self.tcfg):
            return self.reshuffled_plan(batch, generator, trained)
        plan = super().plan(dataclasses.replace(batch, advantages=trained.float()), generator)
        per_chunk = batch.per_chunk(trained)
        means: dict[tuple[int, int], torch.Tensor] = {}
        steps = []
        for units in plan.steps:
            step = []
            for u in units:
                if not self.parallel.sharded and (u.chunk, u.k) not in means:
                    means[u.chunk, u.k] = self.teacher_mean(batch.chunks[u.chunk], u.k)
                step.append(TeacherUnit(**{f.name: getattr(u, f.name) for f in dataclasses.fields(u)},
                                        trained=per_chunk[u.chunk], teacher=means.get((u.chunk, u.k))))
            steps.append(step)
        return Plan(steps, {**plan.logs, "trained_fraction": trained.float().mean().item()}, global_weights=True)

    @classmethod
    def reshuffles(cls, tcfg: FlowOPDConfig) -> bool:
        """Whether kl_reward_grpo's inner epochs after the first train micro-batches of their own
        (``shuffle_draw: per_inner_epoch`` with shuffled micro-batches and several inner epochs)."""
        return (not cls.distils(tcfg) and tcfg.micro_batches == "shuffled" and tcfg.shuffle_draw == "per_inner_epoch"
                and tcfg.inner_epochs > 1)

    def reshuffled_plan(self, batch: StepBatch, generator: torch.Generator, trained: torch.Tensor) -> Plan:
        """Flow-GRPO's global plan run per inner epoch over that epoch's micro-batches, ``updates_per_epoch``
        optimiser steps each. The micro-batches are the authors' (:func:`inner_epoch_micro_batches`): epoch 0's
        are the rollout chunks, cut from the step's permutation keyed by (seed, step, rank) (:meth:`rollout_slots`),
        so one inner epoch plans as without reshuffling; epoch e's come from epoch e − 1's order permuted again,
        keyed by (seed, step, rank, e), and their units carry their rows, read through one :class:`Regrouped`.
        The teachers' (and with β > 0 the reference's) step means are computed once per (rollout chunk, step),
        for the chunks with a trained row in a unit (unsharded; under fsdp the loss computes them), and read at
        each micro-batch's rows."""
        epochs = inner_epoch_micro_batches(batch.chunks, self.tcfg.batch_size, self.tcfg.inner_epochs,
                                           lambda e: self.keyed_generator(self.rank, e, 103))
        where = [(c, i) for c, chunk in enumerate(batch.chunks) for i in range(len(chunk))]
        # each row's identity, as StepBatch.chunk_keys names a chunk's first sample
        keys = [tuple(key) for key in sample_keys(batch.groups).tolist()]
        local = [[ChunkRef(keys[rows[0]], self.rank, j, bool(trained[list(rows)].any()),
                           tuple(self.trained_steps(batch.chunks[where[rows[0]][0]]))) for j, rows in enumerate(mbs)]
                 for mbs in epochs]
        every = self.gather_objects(local)
        per_chunk = batch.per_chunk(trained)
        means = Regrouped(batch.chunks, where, {}, dict(batch.prepared or {}))
        computes = not self.parallel.sharded

        def computed(c: int, k: int) -> None:
            if (c, k) not in means.teacher:
                means.teacher[c, k] = self.teacher_mean(batch.chunks[c], k)
            if self.tcfg.beta > 0 and (c, k) not in means.reference:
                means.reference[c, k] = self.kl_reference(batch.chunks[c], k)

        steps: list[list[TeacherUnit]] = []
        for epoch, mbs in enumerate(epochs):
            refs = [ref for rank in every for ref in rank[epoch]]
            for pairs in global_plan(refs, 1, self.tcfg.updates_per_epoch, generator,
                                     lambda ref, _, e=epoch: self.chosen_steps(ref, e),
                                     count_inactive=self.counts_zero_advantage()):
                units = []
                for ref, k in pairs:
                    if ref.rank != self.rank or not ref.active:
                        continue
                    rows = mbs[ref.index]
                    for c in dict.fromkeys(where[r][0] for r in rows if trained[r]) if computes else ():
                        computed(c, k)
                    if epoch == 0:
                        units.append(TeacherUnit(ref.index, k, len(pairs), len(steps),
                                                 reference=means.reference.get((ref.index, k)) if self.tcfg.beta > 0
                                                 else None, trained=per_chunk[ref.index],
                                                 teacher=means.teacher.get((ref.index, k))))
                    else:
                        units.append(TeacherUnit(ref.index, k, len(pairs), len(steps), trained=trained[list(rows)],
                                                 rows=rows, regrouped=means))
                steps.append(units)
        return Plan(steps, {"trained_fraction": trained.float().mean().item()}, global_weights=True)

    def filler(self, batch: StepBatch, update: int) -> TeacherUnit:
        unit = super().filler(batch, update)
        return TeacherUnit(unit.chunk, unit.k, unit.of, unit.update, trained=batch.per_chunk(self.trained(batch))[0])

    def loss(self, batch: StepBatch | DistillBatch, unit: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        if isinstance(batch, DistillBatch):
            return self.distillation_unit_loss(batch, unit)
        k, teacher, ref = unit.k, unit.teacher, unit.reference
        if unit.rows is None:
            chunk = batch.chunks[unit.chunk]
        else:  # a micro-batch an inner epoch re-formed
            chunk = unit.regrouped.rollout(unit.rows)
            teacher = unit.regrouped.means("teacher", unit.rows, k)
            ref = unit.regrouped.means("reference", unit.rows, k) if self.tcfg.beta > 0 else None
        _, _, old_log_prob = chunk.step(k)
        out = self.step_distribution(chunk, k, self.policy_velocity(chunk, k, unit.update == 0))
        teacher = teacher if teacher is not None else self.teacher_mean(chunk, k)
        gap = coded_kl_gap(self.sampler, chunk.sigmas[k].item(), chunk.sigmas[k + 1].item())
        m = unit.trained.to(out.log_prob.device)
        std = out.std.expand_as(out.mean)[m]
        got = kl_reward_grpo_loss(out.log_prob[m], old_log_prob.to(out.log_prob)[m], out.mean[m], teacher.to(out.mean)[m],
                                  std, gap, kl_scale=self.tcfg.kl_scale, adv_clip=self.tcfg.adv_clip,
                                  clip_range=self.tcfg.clip_range, pairing=self.tcfg.advantage_pairing,
                                  kl_mode=self.tcfg.kl_mode)
        loss = got.loss
        deviation = (got.ratio.detach() - 1).abs()
        info = {"policy_loss": loss.detach(), "kl_teacher": got.kl.detach().mean(), "ratio": got.ratio.detach().mean(),
                "clip_frac": got.clipped.float().mean()}
        if unit.update == 0:  # the sampling weights: the on-policy ratio, 1 up to kernel noise
            info["ratio_dev"] = deviation.max() if deviation.numel() else 0.0
        if self.tcfg.beta > 0:
            ref = ref if ref is not None else self.reference_mean(chunk, k)
            kl = gaussian_mean_kl(out.mean[m], ref.to(out.mean)[m], std, gap, self.tcfg.kl_mode).mean()
            loss = loss + self.tcfg.beta * kl
            info["kl"] = kl.detach()
        return loss / unit.of, info

    # ------------------------------------------------------------------ velocity distillation and the cold start

    def velocity_under(self, weights: list[torch.Tensor] | None, x: torch.Tensor, sigma: torch.Tensor,
                       cond: Conditioning) -> torch.Tensor:
        """``v`` ``(B, S, ...)`` at each of the ``S`` states ``x (B, S, ...)``, ``sigma (B, S)``, under ``weights``
        (None: the anchor), no gradient; the weights are swapped in once for all states."""
        with torch.no_grad(), (self.anchor_weights() if weights is None else swapped_in(self.params, weights)):
            return torch.stack([self.policy.velocity(x[:, s], sigma[:, s], cond, self.guidance())
                                for s in range(x.shape[1])], dim=1)

    def guidance(self) -> float:
        g = self.tcfg.guidance_scale
        return float(self.policy.defaults.get("guidance_scale", 1.0) if g is None else g)

    def rollouts(self, prompts: list[str], metadata: list[dict], step: int, weights: list[torch.Tensor] | None,
                 places: list[int]):
        """ODE rollouts of ``prompts`` under ``weights`` (None: the live weights), each keyed by its place in
        this rank's step batch (``places``), so no rank layout or routing changes a sample's noise."""
        n = self.tcfg.prompts_per_step * self.tcfg.group_size  # every rank holds as many
        groups = torch.tensor([self.rank * n + j for j in places])
        slots = sample_slots(self.policy, prompts, metadata, groups, groups, self.cfg.run.seed, step, False)
        sampling = {int(g): Sampling("ode") for g in groups}
        with torch.no_grad(), swapped_in(self.params, weights) if weights is not None else nullcontext():
            return [roll_out(self.policy, b, sampling[b[0].group], self.tcfg.num_steps, self.tcfg.guidance_scale)
                    for b in rollout_batches(slots, sampling, self.tcfg.batch_size)]

    def distill_batch(self, step: int) -> DistillBatch:
        prompts, metadata, _ = self.step_prompts(step)
        routed_to = self.routed(prompts, step)
        cond = self.policy.encode(prompts)
        batch = self.cold_start(prompts, metadata, routed_to, cond, step) if step < self.cold_start_steps \
            else self.on_policy(prompts, metadata, routed_to, cond, step)
        batch.logs.update(self.route_logs(routed_to))
        return batch

    def cold_start(self, prompts, metadata, routed_to, cond, step) -> DistillBatch:
        """Each prompt's teacher sample (the anchor's where none is routed) noised at a logit-normal t; the
        target is its flow-matching velocity ε − x0, fitted by the conditional velocity."""
        samples: dict[int, torch.Tensor] = {}
        for i in sorted(set(routed_to.tolist())):
            members = (routed_to == i).nonzero().flatten().tolist()
            chosen = ([prompts[j] for j in members], [metadata[j] for j in members], step)
            if i >= 0 or self.anchor is not None:
                chunks = self.rollouts(*chosen, self.teachers[i] if i >= 0 else self.anchor, members)
            else:
                with self.policy.adapter_disabled():
                    chunks = self.rollouts(*chosen, None, members)
            samples.update(zip(members, torch.cat([c.final_latents for c in chunks])))
        x0 = torch.stack([samples[j] for j in range(len(prompts))]).float()
        p = len(prompts)  # each prompt's t and noise keyed by its place in the step (every rank holds p)
        keyed = [torch.Generator().manual_seed(derived_seed(self.cfg.run.seed, step, self.rank * p + n, 79))
                 for n in range(p)]
        return cold_start_batch(x0, keyed, cond)

    def on_policy(self, prompts, metadata, routed_to, cond, step) -> DistillBatch:
        """The student's own ODE states, each labelled by its routed teacher and by the anchor."""
        chunks = self.rollouts(prompts, metadata, step, None, list(range(len(prompts))))
        latents = torch.cat([c.latents[:, :-1] for c in chunks])  # (B, T, ...): the states a velocity is read at
        sigmas = chunks[0].sigmas[:-1]
        p = len(prompts)  # each sample's states keyed by its place in the step (every rank holds p)
        keyed = [torch.Generator().manual_seed(derived_seed(self.cfg.run.seed, step, self.rank * p + n, 83))
                 for n in range(p)]
        x, sigma = drawn_states(latents, sigmas, self.tcfg.states_per_sample or len(sigmas), keyed)
        x = x.to(self.policy.device)
        sigma = sigma.to(x)
        v_teacher, v_anchor = torch.zeros_like(x), torch.zeros_like(x) if self.tcfg.anchor_weight > 0 else None
        for i in sorted(set(routed_to.tolist()) - {-1}):
            m = (routed_to == i).nonzero().flatten()
            v_teacher[m] = self.velocity_under(self.teachers[i], x[m], sigma[m], cond[m])
        if v_anchor is not None:
            v_anchor = self.velocity_under(None, x, sigma, cond)
        logs: dict[str, Any] = {"stage": 1.0}
        if len(self.rewards):
            scored = self.score(torch.cat([c.samples for c in chunks]), prompts, metadata, step=step)
            logs.update(scored.logs)
            logs.update(self.domain_logs(scored.scores, routed_to))
        return DistillBatch(x, sigma, v_teacher, v_anchor, (routed_to >= 0).float(), cond, self.guidance(), logs)

    def domain_logs(self, scores: Any, routed_to: torch.Tensor) -> dict[str, float]:
        """``domain/<i>/<reward>``: each teacher's reward on the student's samples of its own domain (every
        rank's valid samples). A collective."""
        values, valid, routes = self.gather(scores.values), self.gather(scores.valid), self.gather(routed_to)
        logs = {}
        for i, t in enumerate(self.tcfg.teachers):
            if t.reward is not None:
                m = valid.bool() & (routes == i)
                column = values[:, scores.names.index(t.reward)]
                logs[f"domain/{i}/{t.reward}"] = column[m].mean().item() if m.any() else float("nan")
        return logs

    def distillation_unit_loss(self, batch: DistillBatch, unit: SliceUnit) -> tuple[torch.Tensor, dict[str, float]]:
        """The unit's samples at each of their states, averaged over the states."""
        i, cond = unit.index, batch.cond[unit.index]
        per, stats = states_loss(lambda x, sigma: self.policy.velocity(x, sigma, cond, batch.guidance),
                                 batch.x[i], batch.sigma[i], batch.v_teacher[i],
                                 None if batch.v_anchor is None else batch.v_anchor[i], batch.routed[i],
                                 self.tcfg.anchor_weight)
        return per.sum() / unit.total, stats
