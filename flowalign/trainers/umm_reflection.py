"""UMM-Reflection: RL over whole reflection trajectories of one unified multimodal model
(``docs/methods/umm_reflection.md``).

A trajectory of prompt ``c``: the model's first image ``I_0`` (one per prompt group, so G siblings start from
the same image, bit for bit), then up to R rounds of

    reflect:  y_r ~ π_θ(· | I_{r-1}, c)                  (text, token by token; stop phrase or empty: the end)
    revise:   I_r ~ p_θ(· | I_{r-1}, y_r)                 (an SDE rollout, the reflection as edit
                                                           instruction, I_{r-1} the reference image)

The revisions' SDE (``revision_sampler``) is by default the authors' flow transition (``flow_grpo_floored``,
η = ``noise_level`` 1.0): Flow-GRPO's mean with the noise scale ``η·sqrt(σ / (1 − min(σ, 0.95)))`` and their
log-prob (their ``g022_sde_denominator``, mode ``r3_t_ge_0p95``); ``flow_grpo`` (a 0.7) is the former.

Every image state is scored; one group-relative advantage ``A_i`` per trajectory weighs every term of it.
``credit: shaped`` (the authors' released trainer): ``A_i`` of the shaped trajectory reward of
:mod:`flowalign.trainers.parts.reflection_credit` (final score, improvement bonus, regression and premature-stop
penalties; z-score within the group, std floored, clipped); ``credit: final``: the trainer's ``advantage`` of
the final image's reward alone. Then

    L = Σ_i [ w_tok · (1/(N_y·T_i)) Σ_r mean_t [max(−A_i·ρ_{r,t}, −A_i·clip(ρ_{r,t}, 1±ε_tok)) + β_tok·k3_{r,t}]
            + w_rev · (1/(N_K·V_i)) Σ_r mean_k [max(−A_i·r_{r,k}, −A_i·clip(r_{r,k}, 1±ε)) + β_rev·KL_{r,k}] ]

``ρ = π_θ(y_t | ...) / π_old`` (reflections written and scored at ``temperature``),
``r = p_θ(x_{k+1} | x_k) / p_old``, ``k3`` / ``KL`` the terms to the frozen starting model
(:mod:`flowalign.trainers.parts.reference_kl`; the reference: ``adapter_disabled()``) (the revision's SDE steps:
``sde_window_size`` contiguous ones from the first half, drawn per revision), ``T_i`` the trajectory's reflections, ``V_i`` its
revisions, ``N_y`` / ``N_K`` the trajectories of every rank with any reflection / revision (the authors'
per-channel trajectory means). ``optimisers: separate`` (the authors'): the text role's terms are
backpropagated, clipped by their own norm and stepped first, then the revisions' terms on the weights that step left,
clipped and stepped alone (two AdamW parameter groups, as their two optimisers); ``joint``: one step, one clip.
``objective: sft`` is the cold start on the same trajectories, weighted alike:
the best trajectory of each group, when its final image scores above the first, is imitated (negative
log-likelihood of its reflections, flow matching toward its revisions), the others weigh 0.

The loop itself is :func:`flowalign.reflection.reflect`, which evaluation runs too (the final image of the
model's own rounds is scored, reflections at ``eval_temperature``, ODE revisions; ``eval_first_image_only``:
the first image alone).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from pydantic import Field, model_validator

from flowalign import families, plugins
from flowalign.errors import UserError
from flowalign.limits import MAX_COEFFICIENT, MAX_LORA_RANK, MAX_REFLECTION_TOKENS, MAX_ROUNDS
from flowalign.protocols import UnifiedPolicy
from flowalign.reflection import Reflection, Round, reflect
from flowalign.sampling import check_sampler, random_window_start, rollout, sde_step
from flowalign.trainers.base import GroupTrainer, Plan, WeightCopy, derived_seed
from flowalign.trainers.copies import full_reference
from flowalign.trainers.options import (
    AdvantageOptions,
    ReferenceOptions,
    RolloutOptions,
    TrainerConfig,
)
from flowalign.trainers.parts.policy_gradient import ppo_clip_loss
from flowalign.trainers.parts.reference_kl import token_k3, transition_kl
from flowalign.trainers.parts.reflection_credit import (
    ShapedCredit,
    channel_scales,
    shaped_advantages,
    trajectory_rewards,
)

#: widest SDE window of a revision
MAX_SDE_WINDOW = 1000


class UMMReflectionConfig(TrainerConfig, RolloutOptions, AdvantageOptions, ReferenceOptions):
    """``group_size`` trajectories per prompt share its first image; ``num_steps`` / ``guidance_scale`` /
    ``batch_size``: the image rollouts (first images and revisions)."""

    name: Literal["umm_reflection"] = "umm_reflection"
    #: "rl": the trajectory-level policy gradient; "sft": the cold start (imitate each group's best trajectory)
    objective: Literal["rl", "sft"] = "rl"
    #: most reflect → revise rounds of a trajectory (the authors: 3)
    rounds: int = Field(3, ge=1, le=MAX_ROUNDS)
    #: most tokens of one reflection (its end token included)
    max_new_tokens: int = Field(16, ge=1, le=MAX_REFLECTION_TOKENS)
    #: a reflection containing this (case-insensitive), or an empty one, ends the trajectory: no revision
    stop_phrase: str = Field("no change", min_length=1, max_length=200)
    #: the revisions' SDE step: "flow_grpo_floored" (the authors': noise scale η·sqrt(σ/(1 − min(σ, 0.95)))), or
    #: "flow_grpo" (Flow-GRPO's a·sqrt(σ/(1 − σ)), the next σ substituted at σ = 1 only; the former)
    revision_sampler: Literal["flow_grpo_floored", "flow_grpo"] = "flow_grpo_floored"
    #: η / a of the revisions' SDE; null: the sampler's default (flow_grpo_floored: the authors' 1.0 for edits;
    #: flow_grpo: 0.7)
    noise_level: float | None = Field(None, gt=0, le=2)
    #: SDE (and trained) steps of each revision: this many contiguous steps from the first half of its
    #: num_steps, the start drawn per revision (the authors' 2 of the first 10 of 20); 0: every step
    #: but the last. A rollout too short for it gets the widest window that fits
    sde_window_size: int = Field(2, ge=0, le=MAX_SDE_WINDOW)
    #: ε of the revision steps' clipped ratio (the authors' 0.1)
    clip_range: float = Field(0.1, gt=0, le=MAX_COEFFICIENT)
    #: ε_tok of the reflection tokens' clipped ratio (the authors' 0.2)
    token_clip_range: float = Field(0.2, gt=0, le=MAX_COEFFICIENT)
    #: temperature of the reflections written in training; their log-probs (sampled, trained, reference) are
    #: taken at it, log softmax(logits / T) (the authors' 0.9; 1: the model's own distribution)
    temperature: float = Field(0.9, gt=0, le=MAX_COEFFICIENT)
    #: β_tok: weight of the reflection tokens' KL to the starting model, the mean over a reflection's tokens
    #: of the k3 estimator (the authors' 1e-4; 0: no text KL)
    token_kl_beta: float = Field(1e-4, ge=0, le=MAX_COEFFICIENT)
    #: β_rev: weight of the revision steps' KL to the starting model, between the two Gaussian transitions
    #: (the authors' 1e-4; 0: no image KL)
    revision_kl_beta: float = Field(1e-4, ge=0, le=MAX_COEFFICIENT)
    #: "shaped": the authors' trajectory reward from every image state's score (below), z-scored within the
    #: group; "final": the final image's reward through ``advantage`` / ``adv_clip`` (the paper's description)
    credit: Literal["shaped", "final"] = "shaped"
    #: α (shaped): weight of each round's improvement of the score
    reflection_bonus: float = Field(0.3, ge=0, le=MAX_COEFFICIENT)
    #: λ (shaped): weight of each round's regression of the score
    regression_penalty: float = Field(0.5, ge=0, le=MAX_COEFFICIENT)
    #: β (shaped): weight of the improvements beyond the largest one
    sustained_bonus: float = Field(0.3, ge=0, le=MAX_COEFFICIENT)
    #: p (shaped): charged when the model stopped on an image scoring below 1
    premature_stop_penalty: float = Field(0.5, ge=0, le=MAX_COEFFICIENT)
    #: floor of the group's reward std (shaped)
    credit_std_floor: float = Field(0.1, gt=0, le=MAX_COEFFICIENT)
    #: the advantage is clipped to ±credit_clip (shaped)
    credit_clip: float = Field(1.0, gt=0, le=MAX_COEFFICIENT)
    #: w_tok: weight of the reflection tokens' term
    token_weight: float = Field(1.0, ge=0, le=MAX_COEFFICIENT)
    #: w_rev: weight of the revisions' term (the authors' mse_weight 2 against the text's ce_weight 1)
    revision_weight: float = Field(2.0, ge=0, le=MAX_COEFFICIENT)
    #: rank of the language LoRA that writes reflections
    language_lora_rank: int = Field(4, ge=1, le=MAX_LORA_RANK)
    #: alpha of the language LoRA (its scale is alpha / rank)
    language_lora_alpha: float = Field(8.0, gt=0, le=MAX_COEFFICIENT)
    #: temperature of the reflections written in evaluation (0: greedy); training samples at ``temperature``
    eval_temperature: float = Field(0.5, ge=0, le=MAX_COEFFICIENT)
    #: evaluation scores the first image alone, without the reflection loop (single-shot generation)
    eval_first_image_only: bool = False
    #: "separate" (the authors'): the text role (the language LoRA) and the flow role (the transformer's
    #: adapter or weights) are two AdamW parameter groups stepped one after the other, as their two
    #: optimisers: the reflections' terms backpropagated, the text gradient clipped to ``grad_clip`` by its
    #: own norm, the text step; then the revisions' terms on the weights it left, the flow gradient clipped by
    #: its own norm, the flow step (a role with no term on any rank takes no step). "joint" (the former):
    #: one step of both, one clip of their joint norm
    optimisers: Literal["separate", "joint"] = "separate"

    #: what runs saved before these options existed computed (see TrainerConfig.before)
    before = {"optimisers": "joint", "revision_weight": 1.0}

    @model_validator(mode="after")
    def _something_trains(self) -> UMMReflectionConfig:
        if self.token_weight == 0 and self.revision_weight == 0:
            raise ValueError("token_weight and revision_weight are both 0: nothing would train; set one > 0")
        return self

    def shaped_credit(self) -> ShapedCredit:
        return ShapedCredit(self.reflection_bonus, self.regression_penalty, self.sustained_bonus,
                            self.premature_stop_penalty, self.credit_std_floor, self.credit_clip)


# ---------------------------------------------------------------------------------------------- the batch


@dataclass(frozen=True)
class TrajectoryBatch:
    """The step's trajectories: N = prompts × group_size, siblings adjacent. ``coefficients (N,)``: what
    multiplies each trajectory's terms (its advantage under ``rl``, 1 or 0 under ``sft``)."""

    prompts: list[str]
    metadata: list[dict]
    groups: torch.Tensor
    prompt_ids: torch.Tensor
    first: torch.Tensor
    rounds: list[Round]
    final: torch.Tensor
    scores: torch.Tensor
    advantages: torch.Tensor
    coefficients: torch.Tensor
    logs: dict[str, float] = field(default_factory=dict)

    def turn_counts(self) -> torch.Tensor:
        """Reflections written by each trajectory over all rounds ``(N,)`` (its stopping one included)."""
        return sum(((r.tokens != -1).any(1) & r.reflected).long() for r in self.rounds)

    def revision_counts(self) -> torch.Tensor:
        """Revisions of each trajectory over all rounds ``(N,)``."""
        return sum(r.revised.long() for r in self.rounds)


@dataclass(frozen=True)
class TokenUnit:
    """The reflection of trajectory ``index`` in round ``round``, each of its tokens weighted ``scale``."""

    index: int
    round: int
    scale: float


@dataclass(frozen=True)
class RevisionUnit:
    """Step ``k`` of revision batch ``batch`` of round ``round``; per-sample weight ``scale (B,)`` (of this step);
    under
    ``sft`` the flow-matching noise ``noise`` drawn for it."""

    round: int
    batch: int
    k: int
    scale: torch.Tensor = field(compare=False)
    noise: torch.Tensor | None = field(default=None, compare=False)


def sft_coefficients(groups: torch.Tensor, first_scores: torch.Tensor, final_scores: torch.Tensor) -> torch.Tensor:
    """``(N,)``: 1 for the best trajectory of each group (the first of equals) when its final image scores above
    the group's first image, else 0 (the cold start imitates only trajectories that improved)."""
    keep = torch.zeros(len(groups))
    for g in groups.unique().tolist():
        members = (groups == g).nonzero().flatten()
        best = members[int(final_scores[members].argmax())]
        if final_scores[best] > first_scores[best]:
            keep[best] = 1.0
    return keep


# ---------------------------------------------------------------------------------------------- the trainer


class UMMReflectionTrainer(GroupTrainer):
    Config = UMMReflectionConfig
    tcfg: UMMReflectionConfig

    @property
    def sampler(self) -> str:  # type: ignore[override]
        """The revisions' SDE step kind (``revision_sampler``)."""
        return self.tcfg.revision_sampler

    @property
    def noise_level(self) -> float:  # type: ignore[override]
        """η / a of the revisions' SDE: ``noise_level``, or the sampler's default."""
        return check_sampler(self.tcfg.revision_sampler, self.tcfg.noise_level)

    def __init__(self, cfg: Any, tcfg: UMMReflectionConfig, policy: Any, *args: Any, **kw: Any) -> None:
        target = families.get(policy.family).unified  # the family makes its editing model write, if it can
        if target is None:
            raise UserError(f"trainer.name=umm_reflection needs a model that writes about its images and revises them; "
                            f"the {policy.family} family cannot write: use a Qwen-Image-Edit folder (model.path)")
        unified = plugins.load_target(target)
        super().__init__(cfg, tcfg, unified(policy, tcfg.language_lora_rank, tcfg.language_lora_alpha), *args, **kw)
        # evaluation draws what the model does at inference: its own reflection loop, no verifier
        self.unified.reflection = None if tcfg.eval_first_image_only else Reflection(
            tcfg.rounds, tcfg.max_new_tokens, tcfg.stop_phrase, tcfg.eval_temperature)

    @classmethod
    def weight_copies(cls, cfg: Any, tcfg: Any) -> list[WeightCopy]:
        """The revisions' KL reference under full fine-tuning of the transformer: a frozen copy of its starting
        weights (under LoRA the adapter switched off; the text's reference is always the language LoRA off).
        One update per batch on the weights that sampled it, so the old log-probs are the stored ones (no
        behaviour copy)."""
        flow_kl = tcfg.objective == "rl" and tcfg.revision_kl_beta > 0 and tcfg.revision_weight > 0
        return full_reference(tcfg) if flow_kl and cfg.model.finetune == "full" else []

    @classmethod
    def rollouts_per_step(cls, tcfg: Any) -> tuple[int, int, int]:
        """Each prompt's first image and its G trajectories' R revisions."""
        return tcfg.prompts_per_step, tcfg.group_size * tcfg.rounds + 1, tcfg.num_steps

    @property
    def unified(self) -> UnifiedPolicy:
        return self.policy

    def parameter_groups(self) -> Callable[[str, torch.nn.Parameter], str] | None:
        """``optimisers: separate``: "flow" for the generation role's tensors (the editor's trainable ones),
        "text" for the others (the language LoRA), each stepped alone by :meth:`plan`'s steps; joint: None."""
        if self.tcfg.optimisers == "joint":
            return None
        flow: set[int] = set()

        def role(name: str, param: torch.nn.Parameter) -> str:
            if not flow:  # read when the optimiser is built, after any sharding replaced the tensors
                flow.update(id(p) for p in self.unified.editor.trainable.parameters())
            return "flow" if id(param) in flow else "text"

        return role

    # ------------------------------------------------------------------ collect
    def collect(self, step: int) -> TrajectoryBatch:
        """First images (one per group) → R rounds of reflections and revisions → scores and advantages."""
        t0 = time.perf_counter()
        p, g = self.tcfg.prompts_per_step, self.tcfg.group_size
        idx = self.step_indices(step)
        prompts = [self.data.prompts[i] for i in idx for _ in range(g)]
        metadata = [self.data.metadata[i] for i in idx for _ in range(g)]
        groups = torch.arange(self.rank * p, (self.rank + 1) * p).repeat_interleave(g)
        members = torch.arange(g).repeat(p)
        prompt_ids = torch.tensor(idx).repeat_interleave(g)
        with torch.no_grad():
            first = self.first_images(prompts[::g], metadata[::g], groups[::g], step).repeat_interleave(g, dim=0)
        keys = list(zip(groups.tolist(), members.tolist()))
        rounds, images = reflect(
            self.unified, first, prompts,
            Reflection(self.tcfg.rounds, self.tcfg.max_new_tokens, self.tcfg.stop_phrase, self.tcfg.temperature),
            lambda i, salt, r: derived_seed(self.cfg.run.seed, step, *keys[i], salt, r), num_steps=self.tcfg.num_steps,
            guidance_scale=self.tcfg.guidance_scale, batch_size=self.tcfg.batch_size, sampler=self.sampler,
            noise_level=self.noise_level, windows=lambda i, r: self.revision_window(step, r, *keys[i]))
        t1 = time.perf_counter()
        steps = torch.stack([r.images for r in rounds]).flatten(0, 1)
        watched = self.score(steps, prompts * len(rounds), metadata * len(rounds), step=step)  # each round's input
        scored = self.score(images, prompts, metadata, prompt_ids, step)
        before = watched.scores.total.view(len(rounds), -1)
        final = scored.scores.total
        advantages, logs = scored.advantages, dict(scored.logs)
        if self.tcfg.credit == "shaped":
            rewards, advantages = self.shaped(rounds, before, final, groups,
                                              scored.scores.valid & watched.scores.valid.view(len(rounds), -1).all(0))
            logs["credit/reward"] = self.gather(rewards.float()).mean().item()
            logs["zero_adv_fraction"] = (advantages == 0).float().mean().item()
        coefficients = advantages if self.tcfg.objective == "rl" else sft_coefficients(groups, before[0], final)
        logs = {**logs, **self.round_logs(rounds, before, final), "time/rollout": t1 - t0}
        logs["time/reward"] = scored.logs["time/reward"] + watched.logs["time/reward"]
        return TrajectoryBatch(prompts, metadata, groups, prompt_ids, first, rounds, images, final,
                               advantages, coefficients, logs)

    def shaped(self, rounds: list[Round], before: torch.Tensor, final: torch.Tensor, groups: torch.Tensor,
               valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``credit: shaped``: each trajectory's reward from the scores of its image states (``before (R, N)``:
        each round's input, ``final (N,)``) and its advantage within its group (``groups (N,)``: siblings are
        on one rank, so the statistics are this rank's); ``(N,)`` float32 each. A trajectory with an invalid
        score gets 0."""
        n = len(groups)
        after = torch.cat([before[1:], final[None]])  # the image each round's revision left
        states = torch.zeros(n, len(rounds) + 1, dtype=torch.float64)
        states[:, 0] = before[0]
        counts = torch.ones(n, dtype=torch.long)
        stopped_early = torch.zeros(n, dtype=torch.bool)
        for r, rnd in enumerate(rounds):
            for i in rnd.revised.nonzero().flatten().tolist():
                states[i, counts[i]] = after[r, i]
                counts[i] += 1
            stopped_early |= rnd.reflected & ~rnd.revised  # the model said it was done (not the round cap)
        states[~valid] = 0.0  # an invalid score is neither checked nor used (its advantage is 0)
        credit = self.tcfg.shaped_credit()
        rewards = trajectory_rewards(states, counts, stopped_early & (final < 1), credit)
        return rewards.float(), shaped_advantages(rewards, groups, credit, valid).float()

    def revision_window(self, step: int, r: int, group: int, member: int) -> tuple[int, int] | None:
        """The SDE window ``(start, width)`` of the revision of trajectory ``member`` of ``group`` in round ``r``
        at ``step``: ``sde_window_size`` contiguous steps, the start drawn uniformly from the first half of the
        rollout per revision (the authors' per repair call), keyed by (seed, step, group, member, round) so it
        depends on no rank or batch; a rollout too short for the width gets the widest that fits (None: size 0)."""
        n = self.tcfg.num_steps
        width = min(self.tcfg.sde_window_size, n - 1)
        if width < 1:
            return None
        gen = torch.Generator().manual_seed(derived_seed(self.cfg.run.seed, step, group, member, r, 37))
        return random_window_start(n, width, gen, high=max(n // 2, width)), width

    def first_images(self, prompts: list[str], metadata: list[dict], groups: torch.Tensor, step: int) -> torch.Tensor:
        """One image per prompt group ``(P, 3, H, W)``: the model's own ODE sample from the group's noise."""
        out = []
        b = self.tcfg.batch_size
        for s in range(0, len(prompts), b):
            gens = [torch.Generator().manual_seed(derived_seed(self.cfg.run.seed, step, gid, 19))
                    for gid in groups[s : s + b].tolist()]
            drawn = rollout(self.policy, prompts[s : s + b], num_steps=self.tcfg.num_steps, sampler="ode",
                            guidance_scale=self.tcfg.guidance_scale, generators=gens)
            out.append(drawn.samples.float())
        return torch.cat(out)

    def round_logs(self, rounds: list[Round], before: torch.Tensor, final: torch.Tensor) -> dict[str, float]:
        """Per round r (1-based, over every rank's trajectories): ``round{r}/reflected`` (fraction still
        going), ``stop_rate`` (of those, how many ended), ``tokens`` (mean reflection length), ``improved``
        (of the revised, how many scored above the image they revised, by the verifier)."""
        after = torch.cat([before[1:], final[None]])
        rows = []
        for r, rnd in enumerate(rounds):
            lengths = ((rnd.tokens != -1).sum(1) * rnd.reflected).sum()
            up = ((after[r] > before[r]) & rnd.revised).sum()
            rows.append(torch.stack([rnd.reflected.sum(), (rnd.reflected & ~rnd.revised).sum(), lengths,
                                     rnd.revised.sum(), up, torch.tensor(len(rnd.reflected))]).float())
        totals = self.gather(torch.stack(rows)[None]).sum(0)
        logs = {}
        for r, (reflected, stops, lengths, revised, up, n) in enumerate(totals.tolist(), start=1):
            logs[f"round{r}/reflected"] = reflected / n
            logs[f"round{r}/stop_rate"] = stops / reflected if reflected else 0.0
            logs[f"round{r}/tokens"] = lengths / reflected if reflected else 0.0
            logs[f"round{r}/improved"] = up / revised if revised else 0.0
        return logs

    # ------------------------------------------------------------------ plan and loss
    def units(self, batch: TrajectoryBatch, active: tuple[int, int] | None = None) -> list[TokenUnit | RevisionUnit]:
        """Every term of every trajectory, weighted as the authors' trainer weighs them: a reflection's tokens
        share its trajectory's text weight ``w_tok / (N_y · T_i)`` (their mean), a revision's trained steps
        its flow weight ``w_rev / (N_K · V_i)`` (their mean). ``active = (N_y, N_K)``: trajectories with any
        reflection / revision over every rank (default: this rank's)."""
        turns, revisions = batch.turn_counts(), batch.revision_counts()
        if active is None:
            active = (int((turns > 0).sum()), int((revisions > 0).sum()))
        text, flow = channel_scales(turns, active[0]), channel_scales(revisions, active[1])
        units: list[TokenUnit | RevisionUnit] = []
        for r, rnd in enumerate(batch.rounds):
            if self.tcfg.token_weight > 0:
                lengths = (rnd.tokens != -1).sum(1)
                units += [TokenUnit(i, r, self.tcfg.token_weight * float(text[i]) / int(lengths[i]))
                          for i in rnd.reflected.nonzero().flatten().tolist() if lengths[i] > 0]
            if self.tcfg.revision_weight > 0:
                for b, rev in enumerate(rnd.revisions):
                    steps = rev.rollout.trained_steps()
                    scale = (self.tcfg.revision_weight * flow[rev.index] / max(len(steps), 1)).float()
                    for k in steps:
                        noise = None
                        if self.tcfg.objective == "sft":
                            g = self.tcfg.group_size  # siblings are adjacent: member i mod G
                            gens = [self.keyed_generator(int(batch.groups[i]), i % g, r, k, 31)
                                    for i in rev.index.tolist()]
                            x0 = rev.rollout.final_latents
                            noise = torch.stack([torch.randn(x0.shape[1:], generator=gen) for gen in gens])
                        units.append(RevisionUnit(r, b, k, scale, noise))
        return units

    def kl_beta(self, unit: TokenUnit | RevisionUnit) -> float:
        """The unit's KL weight to the starting model (0 under ``sft``)."""
        if self.tcfg.objective != "rl":
            return 0.0
        return self.tcfg.token_kl_beta if isinstance(unit, TokenUnit) else self.tcfg.revision_kl_beta

    def plan(self, batch: TrajectoryBatch, generator: torch.Generator) -> Plan:
        """The units of trajectories with a non-zero coefficient, and under a KL term every unit (the authors
        train every turn and revision, a zero advantage leaving its KL) (a global plan). ``separate``: two
        optimiser steps, the reflections' units stepping the text group, then the revisions' units the flow
        group (the authors' ``update_multiround_group``: text before flow, each clipped alone); a role with
        no term on any rank (no reflection or no revision anywhere, or its weight 0) takes no step, as their
        globally inactive channel. ``joint``: one step of every unit."""
        here = torch.tensor([[int((batch.turn_counts() > 0).sum()), int((batch.revision_counts() > 0).sum())]])
        text, flow = self.gather(here).sum(0).tolist()  # trajectories with any term, over every rank
        units = self.units(batch, (int(text), int(flow)))
        live = batch.coefficients != 0

        def useful(u: TokenUnit | RevisionUnit) -> bool:
            if self.kl_beta(u) > 0:
                return True
            if isinstance(u, TokenUnit):
                return bool(live[u.index])
            return bool(live[batch.rounds[u.round].revisions[u.batch].index].any())

        kept = [u for u in units if useful(u)]
        if self.tcfg.optimisers == "joint":
            return Plan([kept], global_weights=True)
        steps: list[list[TokenUnit | RevisionUnit]] = []
        groups: list[str | None] = []
        if text > 0 and self.tcfg.token_weight > 0:
            steps.append([u for u in kept if isinstance(u, TokenUnit)])
            groups.append("text")
        if flow > 0 and self.tcfg.revision_weight > 0:  # the revisions' forwards run after the text step
            steps.append([u for u in kept if isinstance(u, RevisionUnit)])
            groups.append("flow")
        return Plan(steps, global_weights=True, groups=groups)

    def loss(self, batch: TrajectoryBatch, unit: TokenUnit | RevisionUnit) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        if isinstance(unit, TokenUnit):
            return self.token_loss(batch, unit)
        return self.revision_loss(batch, unit)

    def token_loss(self, batch: TrajectoryBatch, unit: TokenUnit) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``scale · Σ_t [max(−A·ρ_t, −A·clip(ρ_t, 1±ε_tok)) + β_tok·k3_t]`` over the reflection's tokens, log-probs
        at ``temperature`` (``sft``: ``−scale · Σ_t log π``)."""
        rnd, i = batch.rounds[unit.round], unit.index
        mask = rnd.tokens[i] != -1
        args = (rnd.images[i : i + 1], [batch.prompts[i]], rnd.tokens[i : i + 1])
        # rl: the distribution the tokens were drawn from; sft imitates them under the model's own
        temperature = self.tcfg.temperature if self.tcfg.objective == "rl" else 1.0
        lp = self.unified.token_log_probs(*args, temperature=temperature)[0][mask]
        coefficient = batch.coefficients[i].to(lp)
        if self.tcfg.objective == "sft":
            loss = -(coefficient * lp).sum() * unit.scale
            return loss, {"token_nll": -lp.detach().mean()}
        old = rnd.log_probs[i][mask].to(lp)
        per_token, ratio, clipped = ppo_clip_loss(lp, old, coefficient.expand_as(lp), self.tcfg.token_clip_range)
        deviation = (ratio.detach() - 1).abs().max()
        info = {"token_ratio_dev": deviation, "token_clip_frac": clipped.float().mean()}
        beta = self.kl_beta(unit)
        if beta > 0:
            with torch.no_grad(), self.unified.adapter_disabled():
                ref = self.unified.token_log_probs(*args, temperature=temperature)[0][mask]
            k3 = token_k3(lp, ref)
            per_token = per_token + beta * k3
            info["token_kl"] = k3.detach().mean()
        return per_token.sum() * unit.scale, info

    def revision_loss(self, batch: TrajectoryBatch, unit: RevisionUnit) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``Σ_b scale_b · [max(−A_b·r_b, −A_b·clip(r_b)) + β_rev·KL_b]`` at SDE step k of the revisions, ``KL_b``
        between the policy's and the starting model's transitions (``sft``: flow
        matching of the revised image at that step's σ, ``scale_b·A_b·mean‖v − (ε − x0)‖²``)."""
        rev = batch.rounds[unit.round].revisions[unit.batch]
        chunk, k = rev.rollout, unit.k
        coefficient = batch.coefficients[rev.index].float()
        sigma, sigma_next = chunk.sigmas[k].item(), chunk.sigmas[k + 1].item()
        if self.tcfg.objective == "sft":
            x0 = chunk.final_latents
            x = (1 - sigma) * x0 + sigma * unit.noise
            v = self.unified.editor.velocity(x, sigma, chunk.cond, chunk.guidance_scale)
            per_sample = ((v - (unit.noise - x0).to(v)) ** 2).flatten(1).mean(1)
            loss = (per_sample * coefficient.to(v) * unit.scale.to(v)).sum()
            return loss, {"flow_matching": per_sample.detach().mean()}
        x_k, x_next, old = chunk.step(k)
        v = self.unified.editor.velocity(x_k, sigma, chunk.cond, chunk.guidance_scale)
        out = sde_step(self.sampler, v, x_k, sigma, sigma_next, noise_level=self.noise_level, prev_sample=x_next)
        scale = unit.scale.to(out.log_prob)
        per_sample, ratio, clipped = ppo_clip_loss(out.log_prob, old.to(out.log_prob), coefficient.to(out.log_prob),
                                                   self.tcfg.clip_range, scale)
        deviation = (ratio.detach() - 1).abs().max()
        info = {"ratio_dev": deviation, "clip_frac": clipped.float().mean()}
        beta = self.kl_beta(unit)
        if beta > 0:
            with torch.no_grad(), self.unified.adapter_disabled():
                v_ref = self.unified.editor.velocity(x_k, sigma, chunk.cond, chunk.guidance_scale)
                ref = sde_step(self.sampler, v_ref, x_k, sigma, sigma_next, noise_level=self.noise_level,
                               prev_sample=x_next).mean
            kl = transition_kl(out.mean, ref, out.std)
            per_sample = per_sample + beta * kl * scale
            info["kl"] = kl.detach().mean()
        return per_sample.sum(), info
