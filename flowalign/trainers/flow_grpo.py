"""Flow-GRPO (arXiv 2505.05470): GRPO on the per-step Gaussians of an SDE rollout (``docs/methods/flow_grpo.md``).

The loop collects the batch (grouped SDE rollouts with stored log-probs, rewards, advantages); this file
holds the config, the loss and three hooks: how a group is sampled, which (rollout, step) units each
optimiser step accumulates, and the loss of one unit:

    r = exp(ℓ_k(θ) − ℓ_k(θ_old))
    L = mean_{i,k} max(−A_i·r, −A_i·clip(r, 1−ε, 1+ε)) + β·KL(μ_θ ‖ μ_ref)

(``kl_mode: velocity``: β·mean_D (v_θ − v_ref)² in place of the step means' KL, Flow-Factory's v-based KL.)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Callable, Literal

import torch
from pydantic import Field, model_validator

from flowalign.config import Section
from flowalign.limits import MAX_COEFFICIENT, MAX_SAMPLING_STEPS
from flowalign.plan_holdings import Holding, StepHoldings
from flowalign.protocols import Conditioning, FlowPolicy
from flowalign.sampling import Rollout, StepOutput, sde_step
from flowalign.sampling.timesteps import TimestepMap, model_timestep
from flowalign.sampling.windows import random_window_start, shared_window_start
from flowalign.trainers.options import EpochOptions, ReferenceOptions
from flowalign.trainers.copies import WeightCopy, full_reference
from flowalign.trainers.base import GroupTrainer, GroupTrainerConfig, Plan, Sampling, StepBatch, derived_seed
from flowalign.trainers.parts.global_plan import ChunkRef, global_plan
from flowalign.trainers.parts.policy_gradient import ppo_clip_loss
from flowalign.trainers.parts.reductions import masked_max, masked_mean


class FlowGRPOBase(GroupTrainerConfig, EpochOptions):
    """What every Flow-GRPO preset reads: the loop's group rollouts and epochs, the clipped surrogate, the KL
    term and the gradient through CFG. A preset adds the groups below that its hooks read."""

    #: DanceGRPO's grouping: every rollout of a prompt group starts from the same initial noise, so the
    #: rewards within a group differ only through the SDE steps the loss trains (not through x_T, which
    #: no log-probability credits)
    shared_initial_noise: bool = False
    clip_range: float = Field(1e-4, gt=0, le=MAX_COEFFICIENT)
    beta: float = Field(0.04, ge=0, le=MAX_COEFFICIENT)
    kl_mode: Literal["code", "exact"] = "code"
    #: gradient through CFG's unconditional branch: "detached" (the authors' loss; backward through the
    #: conditional branch only) or "full"
    cfg_grad: Literal["detached", "full"] = "detached"
    #: the velocity of the batch's first optimiser step (the sampling weights) with ``cfg_grad: detached``:
    #: "stored" runs the conditional half (B rows) beside the rollout's stored v_u; "batched" reruns the
    #: rollout's ``[uncond; cond]`` forward (2B rows), so the on-policy ratio is 1 even where kernels are not
    #: batch-invariant (GPUs), at the cost of a 2B-row forward and backward (docs/performance.md)
    first_pass: Literal["stored", "batched"] = "stored"


class SDEOptions(Section):
    """The rollouts' stochastic step: its sampler and noise level (a preset with its own step leaves it out)."""

    sampler: Literal["flow_grpo", "cps"] = "flow_grpo"
    #: a for the Flow-GRPO SDE (0.7 SD3.5, 0.9 FLUX), η for CPS (0.8)
    noise_level: float = Field(0.7, gt=0, le=2)


class CPSOptions(Section):
    """The CPS sampler's log-probability (a preset whose sampler cannot be ``cps`` leaves it out)."""

    cps_log_prob: Literal["code", "gaussian"] = "code"


class SDEWindowOptions(Section):
    """Which rollout steps are stochastic (a preset that places its own SDE steps leaves these out)."""

    #: the step to σ = 0 is stochastic, as in the authors' sampler (it is trained only at fraction 1)
    sde_last_step: bool = True
    #: Flow-GRPO-Fast: SDE only on a random window of this width in steps [0, T/2), one per prompt (0: every step)
    sde_window: int = Field(0, ge=0, le=MAX_SAMPLING_STEPS)
    #: [low, high]: the window lies in steps low … high − 1, its start drawn from low … high − sde_window (the
    #: Flow-GRPO authors' sde_window_range; null: [0, T/2]). CrossTimeEdit's steps 1-3 of 10 at width 1: [1, 4]
    sde_window_range: tuple[Annotated[int, Field(ge=0, le=MAX_SAMPLING_STEPS)],
                            Annotated[int, Field(ge=1, le=MAX_SAMPLING_STEPS)]] | None = None
    #: who shares a window: ``per_group`` (each prompt group draws its own, keyed by (seed, step, group)) or
    #: ``per_step`` (one window for the whole step, every rank and prompt: a permutation of the starts seeded
    #: with run.seed + step, as Flow-Factory's scheduler draws its SDE steps, seeded with seed + epoch)
    sde_window_draw: Literal["per_group", "per_step"] = "per_group"

    @model_validator(mode="after")
    def _window_fits(self):
        width, steps = self.sde_window, getattr(self, "num_steps", None)
        if not width and self.sde_window_draw != "per_group":
            raise ValueError(f"trainer.sde_window_draw={self.sde_window_draw} draws an SDE window: set "
                             "trainer.sde_window > 0 (its width)")
        if self.sde_window_range is None:
            return self
        low, high = self.sde_window_range
        if not width:
            raise ValueError(f"trainer.sde_window_range={[low, high]} places an SDE window: set trainer.sde_window "
                             "> 0 (its width)")
        if low + width > high or (steps is not None and high > steps - 1):
            raise ValueError(f"trainer.sde_window_range={[low, high]}: give low + sde_window ≤ high ≤ num_steps − 1 "
                             f"(sde_window={width}, num_steps={steps}; the window lies in steps low … high − 1, and "
                             "the last step is deterministic)")
        return self


class StepFractionOptions(Section):
    """Which stochastic steps are trained: the first fraction of the rollout's steps."""

    #: train the first ⌊fraction·T⌋ of the T rollout steps (0.99 × 10 → steps 0…8), as the authors count
    timestep_fraction: float = Field(0.99, gt=0, le=1)


class StepSubsetOptions(Section):
    """A random subset of a rollout batch's trained steps per inner epoch."""

    #: train a random subset of this many of the trained steps per chunk and epoch (0: all of them)
    steps_per_chunk: int = Field(0, ge=0, le=MAX_SAMPLING_STEPS)


class FlowGRPOConfig(FlowGRPOBase, ReferenceOptions, SDEOptions, CPSOptions, SDEWindowOptions, StepFractionOptions,
                     StepSubsetOptions):
    name: Literal["flow_grpo"] = "flow_grpo"
    #: the KL term: ``code`` / ``exact`` on the SDE step's means (:func:`gaussian_mean_kl`), or ``velocity``,
    #: ``mean_D (v_θ − v_ref)²`` on the guided velocities (:func:`velocity_kl`; Flow-Factory's ``kl_type:
    #: v-based``, the CrossTimeEdit authors')
    kl_mode: Literal["code", "exact", "velocity"] = "code"  # type: ignore[assignment]


# ---------------------------------------------------------------------------------------------- the loss


def gaussian_mean_kl(mean: torch.Tensor, ref_mean: torch.Tensor, std: torch.Tensor, sigma_gap: float,
                     mode: str) -> torch.Tensor:
    """KL between same-variance Gaussian steps ``(B,)``: exact ``Σ_D Δμ²/(2τ²)``, its mean over the elements
    ``mean_D Δμ²/(2τ²)`` (``"mean"``: Pref-GRPO's ``compute_kl_loss``, ``τ`` the step's noise), or Flow-GRPO's
    coded ``mean_D Δμ²/(2s²)`` with ``s² = τ²/sigma_gap`` (``"code"``; = (sigma_gap/D)·exact: :func:`coded_kl_gap`
    gives the gap for each sampler)."""
    sq = ((mean - ref_mean) ** 2) / (2 * std**2)
    if mode == "exact":
        return sq.flatten(1).sum(1)
    if mode == "mean":
        return sq.flatten(1).mean(1)
    return sq.flatten(1).mean(1) * sigma_gap


def velocity_kl(velocity: torch.Tensor, ref_velocity: torch.Tensor) -> torch.Tensor:
    """``kl_mode: velocity``'s per-sample term ``(B,)``: ``mean_D (v_θ − v_ref)²`` over each sample's elements, in
    float32 (Flow-Factory's ``kl_type: v-based``, which the CrossTimeEdit authors train with; their step averages
    it over the micro-batch and weighs it by β, as :meth:`FlowGRPOTrainer.kl_penalty` and the loss do)."""
    return ((velocity.float() - ref_velocity.float()) ** 2).flatten(1).mean(1)


def batched_detached_velocity(policy: FlowPolicy, x: torch.Tensor, sigma: float, cond: Conditioning,
                              guidance: float) -> torch.Tensor:
    """CFG's guided velocity ``(B, ...)`` from one ``[uncond; cond]`` forward of 2B rows, as a rollout computes
    it, with ``cfg_grad: detached``'s gradient: ``v − (1−w)·(v_u − sg(v_u))`` has ``v``'s value bit for bit
    and ``w·∂v_c/∂θ`` as its derivative."""
    v, v_u = policy.velocity_and_unconditional(x, sigma, cond, guidance)
    return v - (1 - guidance) * (v_u - v_u.detach())


def coded_kl_gap(sampler: str, sigma: float, sigma_next: float) -> float:
    """The ``sigma_gap`` that makes ``gaussian_mean_kl(..., "code")`` the authors' coded KL for ``sampler``.

    flow_grpo's ``train_sd3.py`` divides by ``2·std_dev_t²`` with the ``std_dev_t`` its step returns: for its SDE
    (and DanceGRPO's) that is the diffusion coefficient, the step's noise being ``std_dev_t·sqrt(h)``, so
    ``std_dev_t² = τ²/h``; for CPS it is the noise ``τ = σ'·sin(ηπ/2)`` itself, so no ``h``.
    """
    return 1.0 if sampler == "cps" else sigma - sigma_next


def guided_velocity(policy: FlowPolicy, x: torch.Tensor, sigma: float, cond: Conditioning, guidance: float,
                    cfg_grad: str, stored_uncond: torch.Tensor | None = None) -> torch.Tensor:
    """``v = v_u + w·(v_c − v_u)`` ``(B, ...)``. ``cfg_grad="detached"``: ``v_u`` under ``no_grad`` (its own
    forward, or ``stored_uncond`` when the caller has it for these weights), so the backward pass runs
    through the conditional branch only; ``"full"`` (or a model without CFG negatives): the policy's own
    guided velocity."""
    if cfg_grad == "full" or guidance <= 1:
        return policy.velocity(x, sigma, cond, guidance)
    if stored_uncond is not None or hasattr(policy, "unconditional_velocity"):  # the conditional half alone
        v_u = stored_uncond
        if v_u is None:
            with torch.no_grad():
                v_u = policy.unconditional_velocity(x, sigma, cond)
        return policy.velocity(x, sigma, cond, guidance, uncond=v_u)
    uncond = cond.unconditional()
    if uncond is None:
        return policy.velocity(x, sigma, cond, guidance)
    with torch.no_grad():
        v_u = policy.velocity(x, sigma, uncond, 1.0)
    v_c = policy.velocity(x, sigma, cond, 1.0)
    return v_u + guidance * (v_c - v_u)


def steps_over_epochs(steps: int, per_epoch: int, inner_epochs: int) -> int:
    """Distinct steps of a rollout that ``inner_epochs`` epochs train when each picks ``per_epoch`` of its
    ``steps`` candidates: all of them, or at most ``per_epoch`` new ones an epoch (an upper bound where epochs
    pick the same)."""
    return min(steps, per_epoch * inner_epochs)


# ---------------------------------------------------------------------------------------------- hooks


@dataclass(frozen=True)
class StepUnit:
    """Rollout batch ``chunk`` (this rank's index) at timestep ``k``, one of ``of`` units (over all ranks)
    of optimiser step ``update``; what the plan computed for it once per batch: per-sample loss ``weight``
    ``(B,)`` (None: 1) and the reference's step mean ``reference`` (its velocity under ``kl_mode: velocity``;
    None: computed by the loss)."""

    chunk: int
    k: int
    of: int
    update: int
    weight: torch.Tensor | None = field(default=None, compare=False)
    reference: torch.Tensor | None = field(default=None, compare=False)


class FlowGRPOTrainer(GroupTrainer):
    Config = FlowGRPOConfig
    tcfg: FlowGRPOConfig

    @classmethod
    def grads_through_unconditional(cls, tcfg) -> bool:
        """``cfg_grad: detached`` backpropagates through the conditional half alone (the unconditional velocity
        stored by the rollout, or computed without grad) unless ``first_pass: batched`` reruns the rollout's
        ``[uncond; cond]`` batch with grad."""
        return tcfg.cfg_grad != "detached" or tcfg.first_pass == "batched"

    @classmethod
    def weight_copies(cls, cfg, tcfg) -> list[WeightCopy]:
        """The KL term's ``μ_ref`` under full fine-tuning comes from a frozen copy of the starting weights."""
        return full_reference(tcfg) if tcfg.beta > 0 and cfg.model.finetune == "full" else []

    @classmethod
    def reference_steps(cls, tcfg) -> int:
        """Steps of each sample whose KL reference mean a step stores (:meth:`prepare`, :meth:`plan`), as
        :meth:`trained_steps` and :meth:`chosen_steps` pick them: of the SDE steps (every step, the step to
        σ = 0 unless ``sde_last_step`` is off, or an ``sde_window``) the first ``⌊T·timestep_fraction⌋`` (at
        least one), and with ``steps_per_chunk`` at most that many an inner epoch. A preset that picks its
        steps otherwise overrides it."""
        t = tcfg.num_steps
        sde = tcfg.sde_window if tcfg.sde_window else (t if tcfg.sde_last_step else t - 1)
        steps = max(1, min(sde, int(tcfg.timestep_fraction * t)))
        per_epoch = tcfg.steps_per_chunk if 0 < tcfg.steps_per_chunk < steps else steps
        return steps_over_epochs(steps, per_epoch, tcfg.inner_epochs)

    @classmethod
    def step_holdings(cls, tcfg) -> StepHoldings:
        """The loop's step (its rollouts held through the update), and with a KL (``beta > 0``) every
        sample's reference step means (:meth:`reference_steps` float32 latents), computed while the rewards
        are scored and in :meth:`plan`, kept through the update; under fsdp the loss computes each one and
        none is kept (:attr:`flowalign.plan_holdings.Holding.means`)."""
        base = super().step_holdings(tcfg)
        if tcfg.beta <= 0:
            return base
        g = cls.rollouts_per_step(tcfg)[1]
        return StepHoldings(Holding(rollouts=g, means=g * cls.reference_steps(tcfg)), base.moments)

    def shares_initial_noise(self) -> bool:
        return self.tcfg.shared_initial_noise

    @property
    def sampler(self) -> str:  # type: ignore[override]
        return self.tcfg.sampler

    @property
    def noise_level(self) -> float:  # type: ignore[override]
        return self.tcfg.noise_level

    @property
    def cps_log_prob(self) -> str:
        """The CPS step's log-probability form (read only when the sampler is ``cps``, so a preset whose
        sampler cannot be leaves ``cps_log_prob`` out of its config)."""
        return self.tcfg.cps_log_prob if self.sampler == "cps" else "code"

    def sampling(self, group: int) -> Sampling:
        """SDE on every step (Flow-GRPO-Fast: on a window in ``sde_window_range``, drawn per prompt group, seeded
        by (seed, step, group), or with ``sde_window_draw: per_step`` once for the step, seeded by seed + step)."""
        window = None
        if self.tcfg.sde_window:
            t, width = self.tcfg.num_steps, self.tcfg.sde_window
            low, high = self.tcfg.sde_window_range or (0, None)
            if self.tcfg.sde_window_draw == "per_step":
                start = shared_window_start(t, width, self.cfg.run.seed + self.step, low, high)
            else:
                g = torch.Generator().manual_seed(derived_seed(self.cfg.run.seed, self.step, group, 11))
                start = random_window_start(t, width, g, low, high)
            window = (start, width)
        return Sampling(self.sampler, self.noise_level, window, self.tcfg.sde_last_step,
                        cps_log_prob=self.cps_log_prob, keep_unconditional=self.reuses_unconditional,
                        grid=self.rollout_grid, timestep_form=self.timestep_form)

    #: the σ grid the rollouts sample on (None: the policy's own) and what the transformer reads of its timestep
    #: in rollouts and updates alike (None: the pipeline's); DanceGRPO's loop sets its authors'
    rollout_grid: Callable[[int], torch.Tensor] | None = None
    timestep_form: TimestepMap | None = None

    @property
    def reuses_unconditional(self) -> bool:
        """Whether rollouts keep CFG's unconditional velocities for the batch's first optimiser step.

        With the branch detached (``cfg_grad="detached"``) and the weights still those that sampled, the
        loss's ``v_u`` is the rollout's: reusing it saves one no-grad forward per trained unit."""
        return self.tcfg.cfg_grad == "detached"

    def trained_steps(self, chunk: Rollout) -> list[int]:
        """The stochastic steps among the first ⌊timestep_fraction·T⌋ steps (at least the first one)."""
        steps = chunk.trained_steps()
        limit = max(1, int(self.tcfg.timestep_fraction * chunk.num_steps))
        return [k for k in steps if k < limit] or steps[:1]

    def prepare(self, batch: StepBatch, scored: Callable[[], bool]) -> dict[tuple[int, int], torch.Tensor]:
        """The KL reference's step means ``{(chunk index, k): (B, ...)}``, one (chunk, step) at a time until
        the scores are in: chunk by chunk, the steps each trains in the first inner epoch first.

        They read no advantage, and the weights are still those that sampled, so each is the mean the
        plan would compute (bit for bit); a chunk that turns out to have no non-zero advantage had its
        means computed in time the step would have spent waiting. Under fsdp nothing is prepared (every
        forward is a collective, and ranks stop at different pieces)."""
        means: dict[tuple[int, int], torch.Tensor] = {}
        if self.tcfg.beta <= 0 or self.parallel.sharded:
            return means
        refs = [ChunkRef(key, self.rank, i, True, tuple(self.trained_steps(c)))
                for i, (key, c) in enumerate(zip(batch.chunk_keys(), batch.chunks))]
        for epoch in range(self.tcfg.inner_epochs):
            for ref in refs:
                for k in self.chosen_steps(ref, epoch):
                    if scored():
                        return means
                    if (ref.index, k) not in means:
                        means[ref.index, k] = self.kl_reference(batch.chunks[ref.index], k)
        return means

    def plan(self, batch: StepBatch, generator: torch.Generator) -> Plan:
        """Inner epochs over the chunks with a non-zero advantage, ``updates_per_epoch`` optimiser steps
        each; every step accumulates over its chunks × trained steps (``steps_per_chunk``: a random subset).
        Where :meth:`counts_zero_advantage`, the other chunks take their places in the steps and count in
        their sizes without being run.

        The plan is global (:func:`global_plan` over every rank's chunks): each rank runs its own chunks'
        units, each weighted by 1 / the step's unit count over all ranks, so N ranks take the single
        process's optimiser steps. Each unit carries its chunk's :meth:`sample_weights` and, with a KL
        term, the reference's mean at its step (computed here once per (chunk, step); under fsdp the loss
        computes it, since every forward is a collective and ranks hold different units); those
        :meth:`prepare` computed while the rewards were scored are taken from ``batch.prepared``."""
        adv = batch.per_chunk(batch.advantages)
        local = [ChunkRef(key, self.rank, i, bool(adv[i].abs().sum() > 0), tuple(self.trained_steps(c)))
                 for i, (key, c) in enumerate(zip(batch.chunk_keys(), batch.chunks))]
        chunks = [c for refs in self.gather_objects(local) for c in refs]
        steps = global_plan(chunks, self.tcfg.inner_epochs, self.tcfg.updates_per_epoch, generator, self.chosen_steps,
                            count_inactive=self.counts_zero_advantage())
        weights = self.sample_weights(batch)
        per_chunk = [None] * len(batch.chunks) if weights is None else batch.per_chunk(weights)
        references: dict[tuple[int, int], torch.Tensor] = dict(batch.prepared or {})
        units = []
        for n, pairs in enumerate(steps):
            mine = [(c.index, k) for c, k in pairs if c.rank == self.rank and c.active]
            if self.tcfg.beta > 0 and not self.parallel.sharded:
                for key in mine:
                    if key not in references:
                        references[key] = self.kl_reference(batch.chunks[key[0]], key[1])
            units.append([StepUnit(i, k, len(pairs), n, per_chunk[i], references.get((i, k))) for i, k in mine])
        return Plan(units, global_weights=True)

    def counts_zero_advantage(self) -> bool:
        """Whether a chunk with no non-zero advantage counts in its optimiser step's size (not run: its
        gradient is zero). Flow-GRPO's authors filter such samples out: no."""
        return False

    def sample_weights(self, batch: StepBatch) -> torch.Tensor | None:
        """Per-sample loss weights ``(N,)`` of the batch (None: every sample weighs 1)."""
        return None

    def filler(self, batch: StepBatch, update: int) -> StepUnit:
        """The first chunk's first trained step in optimiser step ``update`` (fsdp padding; its loss is
        multiplied by 0)."""
        return StepUnit(0, self.trained_steps(batch.chunks[0])[0], 1, update)

    def chosen_steps(self, chunk: ChunkRef, epoch: int) -> list[int]:
        """The chunk's trained steps in ``epoch``: all, or ``steps_per_chunk`` drawn from a generator keyed by
        the chunk's identity and the epoch (the same whichever rank holds the chunk)."""
        steps = list(chunk.steps)
        if 0 < self.tcfg.steps_per_chunk < len(steps):
            pick = torch.randperm(len(steps), generator=self.keyed_generator(*chunk.key, epoch, 17))
            steps = [steps[j] for j in sorted(pick[: self.tcfg.steps_per_chunk].tolist())]
        return steps

    def step_distribution(self, chunk: Rollout, k: int, velocity: torch.Tensor) -> StepOutput:
        """The rollout's Gaussian at step ``k`` under ``velocity``, with the stored ``x_{k+1}``'s log-prob."""
        x_k, x_next, _ = chunk.step(k)
        return sde_step(self.sampler, velocity, x_k, chunk.sigmas[k].item(), chunk.sigmas[k + 1].item(),
                        noise_level=self.noise_level, prev_sample=x_next, cps_log_prob=self.cps_log_prob)

    def reference_mean(self, chunk: Rollout, k: int) -> torch.Tensor:
        """``μ_ref`` of ``chunk`` at step ``k``: the step's Gaussian mean under the reference (adapter
        disabled, or the frozen starting weights), no grad."""
        x_k, sigma = chunk.step(k)[0], chunk.sigmas[k].item()
        with torch.no_grad(), self.policy.adapter_disabled(), model_timestep(self.policy, self.timestep_form, sigma):
            v = self.policy.velocity(x_k, sigma, chunk.cond, chunk.guidance_scale)
            return self.step_distribution(chunk, k, v).mean

    def reference_velocity(self, chunk: Rollout, k: int) -> torch.Tensor:
        """``v_ref`` of ``chunk`` at step ``k``: the reference's guided velocity at the rollout's ``x_k``
        (adapter disabled, or the frozen starting weights), no grad."""
        x_k, sigma = chunk.step(k)[0], chunk.sigmas[k].item()
        with torch.no_grad(), self.policy.adapter_disabled(), model_timestep(self.policy, self.timestep_form, sigma):
            return self.policy.velocity(x_k, sigma, chunk.cond, chunk.guidance_scale)

    def kl_reference(self, chunk: Rollout, k: int) -> torch.Tensor:
        """What the KL term compares the policy with at step ``k``: the reference's step mean
        (:meth:`reference_mean`), or its velocity under ``kl_mode: velocity`` (:meth:`reference_velocity`)."""
        if self.tcfg.kl_mode == "velocity":
            return self.reference_velocity(chunk, k)
        return self.reference_mean(chunk, k)

    def policy_velocity(self, chunk: Rollout, k: int, sampling_weights: bool) -> torch.Tensor:
        """The policy's guided velocity at the rollout's ``x_k`` ``(B, ...)``, with gradients. While the
        weights are still those that sampled (``sampling_weights``: the batch's first optimiser step), a
        detached ``v_u`` is the one the rollout stored: only the conditional half runs."""
        stored = chunk.unconditional_velocities
        x, sigma, w = chunk.step(k)[0], chunk.sigmas[k].item(), chunk.guidance_scale
        with model_timestep(self.policy, self.timestep_form, sigma):
            if (sampling_weights and self.tcfg.first_pass == "batched" and self.tcfg.cfg_grad == "detached" and w > 1
                    and hasattr(self.policy, "velocity_and_unconditional")):
                return batched_detached_velocity(self.policy, x, sigma, chunk.cond, w)
            return guided_velocity(self.policy, x, sigma, chunk.cond, w, self.tcfg.cfg_grad,
                                   stored[:, k] if sampling_weights and stored is not None else None)

    def surrogate(self, chunk: Rollout, k: int, out: StepOutput, old_log_prob: torch.Tensor, adv: torch.Tensor,
                  weight: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The per-sample clipped surrogate of step ``k`` ``(B,)``, its ratio and clipped flag (a hook:
        GRPO-Guard normalises the ratio here)."""
        return ppo_clip_loss(out.log_prob, old_log_prob, adv, self.tcfg.clip_range, weight)

    def kl_coefficient(self) -> float:
        """The KL term's weight β this step (a hook: Pref-GRPO's adaptive controller moves it)."""
        return self.tcfg.beta

    def kl_penalty(self, batch: StepBatch, unit: StepUnit, kl: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
        """The unit's KL term from the per-sample KL ``(B,)``: its mean over the ``active`` samples (a hook:
        GARDO gates it to its uncertain samples)."""
        return masked_mean(kl, active)

    def loss(self, batch: StepBatch, unit: StepUnit) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        chunk, k = batch.chunks[unit.chunk], unit.k
        adv, weight = batch.per_chunk(batch.advantages)[unit.chunk], unit.weight
        x_k, _, old_log_prob = chunk.step(k)
        velocity = self.policy_velocity(chunk, k, unit.update == 0)
        out = self.step_distribution(chunk, k, velocity)
        adv, old_log_prob = adv.to(out.log_prob, non_blocking=True), old_log_prob.to(out.log_prob, non_blocking=True)
        per_sample, ratio, clipped = self.surrogate(chunk, k, out, old_log_prob, adv,
                                                    None if weight is None else weight.to(out.log_prob, non_blocking=True))
        # samples with zero advantage are dropped from the means (masked, not indexed: no host wait)
        active = adv != 0
        loss = masked_mean(per_sample, active)
        deviation = (ratio.detach() - 1).abs()
        clip_frac = masked_mean(clipped.float(), active)
        # logged as tensors, read back once at the end of the step
        info = {"ratio": ratio.detach().mean(), "clip_frac": clip_frac, "policy_loss": loss.detach()}
        if unit.update == 0:  # the sampling weights: the on-policy ratio, 1 up to kernel noise
            info["ratio_dev"] = masked_max(deviation, active)
        else:  # after the batch's first optimiser step: where the trust region acts
            info.update({"ratio_dev_late": masked_mean(deviation, active), "clip_frac_late": clip_frac})
        if self.tcfg.beta > 0:
            ref = unit.reference if unit.reference is not None else self.kl_reference(chunk, k)
            if self.tcfg.kl_mode == "velocity":
                per_sample_kl = velocity_kl(velocity, ref.to(velocity.device, non_blocking=True))
            else:
                gap = coded_kl_gap(self.sampler, chunk.sigmas[k].item(), chunk.sigmas[k + 1].item())
                per_sample_kl = gaussian_mean_kl(out.mean, ref, out.std, gap, self.tcfg.kl_mode)
            kl = self.kl_penalty(batch, unit, per_sample_kl, active)
            loss = loss + self.kl_coefficient() * kl
            info["kl"] = kl.detach()
        return loss / unit.of, info
