"""DGPO, Direct Group Preference Optimization (arXiv 2510.08425; ``docs/methods/dgpo.md``).

ODE rollouts (with or without CFG), the loop's advantages, then a DPO over groups rather than pairs:
each rollout endpoint ``x0`` is re-noised, ``x_t = (1−t)·x0 + t·ε`` with one ε per prompt group, and
with the denoising losses ``d_i = mean(v_θ(x_t) − (ε − x0))²`` (conditional velocity) and ``d_i^ref``
(the reference, at ``reference_guidance``) a group g scores

    S_g = (β/G)·Σ_{i∈g} A_i·(d_i − d_i^ref),      L_g = −log σ(−S_g)

(the advantage-weighted implicit rewards ``−β(d_i − d_i^ref)`` of the group's samples prefer its
positive half to its negative half). The backward pass uses the authors' surrogate of the same gradient,
``σ(sg S_g)·A_i·d_i`` averaged over the samples (= G/β × ∇L_g summed), where ``d_i`` is detached on a
sample whose ratio ``exp(d_old − d)`` already left ``1 ± clip_range`` on its advantage's side; plus
``β_KL·mean(v_θ − v_ref)²``.

``rollout_solver: dpm2`` samples the rollouts as the authors' SD3.5 runs do: diffusers'
``DPMSolverMultistepScheduler`` (DPM-Solver++(2), flow prediction, the scheduler config of Sana's
diffusers release with ``flow_shift`` 3) on that scheduler's own 10-step grid, the transformer reading its
integer timesteps (:mod:`flowalign.sampling.ode_solvers`), and a trained step re-noises at that integer
timestep over 1000 and the transformer reads it (``model_timestep: truncated``); ``euler`` is the policy's
Euler ODE on its own grid.

As the authors' recipes do (``gradient_accumulation_steps`` = batches per epoch × trained timesteps), one
optimiser step takes every block and every trained timestep of an epoch, the loss averaged over them
(``step_per: epoch``); ``step_per: timestep`` steps once per trained timestep.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, replace
from typing import Any, Literal

import torch
from pydantic import Field

from flowalign.ema import EMA
from flowalign.limits import MAX_COEFFICIENT, MAX_GUIDANCE, MAX_LR, MAX_SAMPLING_STEPS, MAX_TRAIN_STEPS, MAX_UPDATES
from flowalign.protocols import Conditioning
from flowalign.sampling.ode_solvers import OdeSolver
from flowalign.sampling.timesteps import TimestepMap, fixed, model_timestep
from flowalign.trainers.options import ReferenceOptions
from flowalign.trainers.copies import WeightCopy, full_reference
from flowalign.trainers.base import GroupTrainer, GroupTrainerConfig, Plan, StepBatch
from flowalign.trainers.parts.policy_average import ramped_decay
from flowalign.trainers.parts.reductions import per_sample_mean


class DGPOConfig(GroupTrainerConfig, ReferenceOptions):
    name: Literal["dgpo"] = "dgpo"
    #: what runs saved before these options existed computed (see TrainerConfig.before)
    before = {"step_per": "timestep", "old_policy": "sampling", "model_timestep": "continuous"}
    #: passes over the batch, each drawing its own train_timesteps (its optimiser steps: step_per)
    inner_epochs: int = Field(1, ge=1, le=MAX_UPDATES)
    lr: float = Field(3e-4, gt=0, le=MAX_LR)
    #: β of the group DPO
    dpo_beta: float = Field(100.0, gt=0, le=MAX_COEFFICIENT)
    #: grid steps trained per epoch, drawn without replacement from 0 … last_step
    train_timesteps: int = Field(4, ge=1, le=MAX_SAMPLING_STEPS)
    #: the last grid index the trained steps are drawn from (0 is pure noise)
    last_step: int = Field(6, ge=0, le=MAX_SAMPLING_STEPS)
    #: one forward-process noise per prompt group (false: one per sample)
    shared_noise: bool = True
    #: a sample's d_i stops training once exp(d_old − d_i) leaves 1 ± clip_range on its advantage's side (0: off)
    clip_range: float = Field(0.01, ge=0, le=MAX_COEFFICIENT)
    #: weight of mean(v_θ − v_ref)² (the adapter switched off / the frozen copy)
    beta: float = Field(0.02, ge=0, le=MAX_COEFFICIENT)
    #: CFG scale of the reference velocity: 1 with CFG rollouts, the CFG scale with CFG-free rollouts
    reference_guidance: float = Field(1.0, ge=1.0, le=MAX_GUIDANCE)
    #: one optimiser step per epoch over all its trained timesteps (the authors'), or one per trained timestep
    step_per: Literal["epoch", "timestep"] = "epoch"
    #: rollout ODE solver: the policy's Euler steps on its grid, or the authors' DPM-Solver++(2) on its flow grid
    rollout_solver: Literal["euler", "dpm2"] = "euler"
    #: flow_shift of the dpm2 grid (theirs 3; "can be changed from 1 to 6")
    dpm_flow_shift: float = Field(3.0, gt=0, le=MAX_COEFFICIENT)
    #: with rollout_solver dpm2, where a trained grid step re-noises and what the transformer reads there:
    #: "truncated", the rollout's integer timestep t = trunc(1000·σ_k), re-noised at t/1000 and read as t (the
    #: authors'); "continuous", σ_k read as 1000·σ_k (the former form). Euler rollouts train at σ_k, 1000·σ_k.
    model_timestep: Literal["truncated", "continuous"] = "truncated"
    #: where the clip's old losses d_old come from: "average", a moving average of the trained weights with
    #: decay min(old_decay, 0.001·s) after s optimiser steps, moved after each batch's optimiser steps (the
    #: authors' ema_ref); "sampling", the weights that sampled the batch (the former form)
    old_policy: Literal["average", "sampling"] = "average"
    #: the cap of that average's decay (the authors' 0.3)
    old_decay: float = Field(0.3, ge=0, lt=1)
    #: with old_policy: average, roll out with the average's weights once more than this many optimiser steps
    #: are taken (the authors' switch_ema_ref, 500 in their GenEval recipe); null: always the policy's
    sample_with_average_after: int | None = Field(500, ge=0, le=MAX_TRAIN_STEPS)


# ---------------------------------------------------------------------------------------------- the loss


def group_scores(d: torch.Tensor, d_ref: torch.Tensor, adv: torch.Tensor, groups: torch.Tensor, beta: float,
                 group_size: int) -> torch.Tensor:
    """``S_g = (β/G)·Σ_{i∈g} A_i·(d_i − d_i^ref)`` per sample (its group's score) ``(B,)``; ``groups``
    are indices 0 … n_groups−1 (on any device: the batch keeps its group ids on the CPU)."""
    n = int(groups.max()) + 1  # read where the ids are (on the CPU, no wait for the device)
    groups = groups.to(d.device, non_blocking=True)  # scatter_add_ needs its index on the values' device
    sums = torch.zeros(n, dtype=d.dtype, device=d.device).scatter_add_(0, groups, adv * beta * (d - d_ref) / group_size)
    return sums[groups]


def dgpo_loss(d: torch.Tensor, d_ref: torch.Tensor, adv: torch.Tensor, groups: torch.Tensor, beta: float,
              group_size: int) -> torch.Tensor:
    """Per-sample surrogate ``σ(sg S_g)·A_i·d_i`` ``(B,)``: summed, its gradient is
    ``(G/β)·Σ_g ∇(−log σ(−S_g))`` (the group DPO loss's)."""
    weight = torch.sigmoid(group_scores(d.detach(), d_ref, adv, groups, beta, group_size))
    return weight * adv * d


def clipped_denoising_loss(d: torch.Tensor, d_old: torch.Tensor, adv: torch.Tensor, clip_range: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``d`` detached where ``r = exp(d_old − d)`` is past ``1+ε`` (A > 0) or below ``1−ε`` (A ≤ 0); and the mask."""
    ratio = torch.exp(d_old - d.detach())
    clip = torch.where(adv > 0, ratio > 1 + clip_range, ratio < 1 - clip_range)
    return torch.where(clip, d.detach(), d), clip


def optimiser_steps(timesteps: list[list[int]], step_per: str) -> list[list[int]]:
    """The grid steps each optimiser step trains, given each epoch's drawn ``timesteps``: one step per epoch
    holding all of them (``epoch``, the authors'), or one step per timestep (``timestep``)."""
    if step_per == "epoch":
        return [list(ks) for ks in timesteps]
    return [[k] for ks in timesteps for k in ks]


# ---------------------------------------------------------------------------------------------- hooks


@dataclass(frozen=True)
class GroupUnit:
    """Chunks ``chunks`` (this rank's indices; whole prompt groups) re-noised at grid step ``k``: noise
    ``eps (N, ...)``, reference losses ``d_ref (N,)`` and velocities ``v_ref`` (for the KL; None at β=0),
    ``d_old (N,)`` under the moving average (or the batch's sampling weights; None without clipping);
    ``total``: samples × trained timesteps of the optimiser step over all ranks."""

    chunks: tuple[int, ...]
    k: int
    eps: torch.Tensor
    d_ref: torch.Tensor
    v_ref: torch.Tensor | None
    d_old: torch.Tensor | None
    total: int


def group_blocks(batch: StepBatch) -> list[tuple[int, ...]]:
    """Consecutive chunks that together hold whole prompt groups (no group split between two blocks)."""
    blocks: list[tuple[int, ...]] = []
    current: list[int] = []
    start = 0
    for i, chunk in enumerate(batch.chunks):
        current.append(i)
        end = start + len(chunk)
        if end == len(batch.groups) or batch.groups[end] != batch.groups[end - 1]:
            blocks.append(tuple(current))
            current = []
        start = end
    return blocks


def rollout_sampler(tcfg: DGPOConfig) -> OdeSolver:
    """The rollouts' solver: Euler on the policy's grid, or DPM-Solver++(2) on the scheduler's flow grid with
    integer timesteps (the authors' ``DPMSolverMultistepScheduler`` loop)."""
    if tcfg.rollout_solver == "euler":
        return OdeSolver("euler")
    return OdeSolver("dpm2", grid="flow_shift", flow_shift=tcfg.dpm_flow_shift, timestep="truncated")


class DGPOTrainer(GroupTrainer):
    Config = DGPOConfig
    tcfg: DGPOConfig

    @property
    def sampler(self) -> OdeSolver:  # type: ignore[override]
        return rollout_sampler(self.tcfg)

    def __init__(self, *args: Any, **kw: Any):
        super().__init__(*args, **kw)
        #: the moving average the clip's old losses (and, late, the rollouts) come from
        self.average = EMA(self.params, self.tcfg.old_decay) if self.holds_average(self.tcfg) else None

    @staticmethod
    def holds_average(tcfg: DGPOConfig) -> bool:
        """Whether a moving average of the trained weights is kept: for the clip's old losses, or to sample."""
        return tcfg.old_policy == "average" and (tcfg.clip_range > 0 or tcfg.sample_with_average_after is not None)

    @classmethod
    def weight_copies(cls, cfg, tcfg) -> list[WeightCopy]:
        """The reference under full fine-tuning (d_ref always needs it) and the moving average, a copy of the
        trained tensors swapped in for its passes."""
        reference = full_reference(tcfg) if cfg.model.finetune == "full" else []
        return reference + ([WeightCopy("snapshot")] if cls.holds_average(tcfg) else [])

    def steps_per_batch(self) -> int:
        """Optimiser steps a batch takes (:func:`optimiser_steps`)."""
        return self.tcfg.inner_epochs * (1 if self.tcfg.step_per == "epoch" else self.tcfg.train_timesteps)

    def collect(self, step: int) -> StepBatch:
        """The loop's batch, rolled out with the moving average's weights once more than
        ``sample_with_average_after`` optimiser steps are taken (the authors' ``switch_ema_ref``)."""
        after = self.tcfg.sample_with_average_after
        if self.average is not None and after is not None and step * self.steps_per_batch() > after:
            with self.average.swapped_in():
                return super().collect(step)
        return super().collect(step)

    def level(self, batch: StepBatch, chunk: int, k: int) -> tuple[float, TimestepMap | None]:
        """The σ grid step ``k`` of ``chunk``'s rollouts is re-noised at, and the transformer's timestep there
        (None: the pipeline's 1000·σ). With ``dpm2`` and ``model_timestep: truncated``, the rollout's integer
        timestep ``t = trunc(1000·σ_k)`` (float32, as the rollout read it) and σ = t/1000 in float32, as the
        authors' ``sigmas_t = t / 1000`` of their stored int64 timesteps."""
        sigma = batch.chunks[chunk].sigmas[k]
        if self.tcfg.rollout_solver == "dpm2" and self.tcfg.model_timestep == "truncated":
            t = torch.trunc(sigma.float() * 1000)
            return float(t / 1000), fixed(float(t))
        return sigma.item(), None

    def noised(self, batch: StepBatch, unit: GroupUnit) -> tuple[torch.Tensor, torch.Tensor, Conditioning]:
        """The unit's re-noised endpoints ``x_t (N, ...)``, target ``ε − x0`` and conditioning."""
        x0, cond, _ = self.block(batch, unit.chunks)
        sigma, _ = self.level(batch, unit.chunks[0], unit.k)
        eps = unit.eps.to(x0)
        return (1 - sigma) * x0 + sigma * eps, eps - x0, cond

    def velocity(self, level: tuple[float, TimestepMap | None], x_t: torch.Tensor, cond: Conditioning,
                 guidance: float) -> torch.Tensor:
        """The policy's velocity at a trained grid step's re-noised ``x_t (N, ...)``, at the step's
        :meth:`level` (its σ and the timestep the transformer reads)."""
        sigma, form = level
        with model_timestep(self.policy, form, sigma):
            return self.policy.velocity(x_t, sigma, cond, guidance)

    def denoising_loss(self, batch: StepBatch, unit: GroupUnit) -> torch.Tensor:
        """``d (N,)``: the conditional velocity's mean squared error at the unit's re-noised endpoints."""
        x_t, target, cond = self.noised(batch, unit)
        v = self.velocity(self.level(batch, unit.chunks[0], unit.k), x_t, cond, 1.0)
        return per_sample_mean((v - target) ** 2)

    def block(self, batch: StepBatch, chunks: tuple[int, ...]) -> tuple[torch.Tensor, Conditioning, torch.Tensor]:
        """The block's endpoints ``(N, ...)``, conditioning and global group ids."""
        x0 = torch.cat([batch.chunks[i].final_latents for i in chunks]).to(self.policy.device)
        cond = Conditioning.cat([batch.chunks[i].cond for i in chunks])
        start = sum(len(c) for c in batch.chunks[: chunks[0]])
        return x0, cond, batch.groups[start : start + len(x0)]

    def noise(self, groups: torch.Tensor, members: list[int], k: int, shape: torch.Size) -> torch.Tensor:
        """ε per sample at grid step ``k``: one per group (``shared_noise``) or per sample, keyed by identity."""
        if self.tcfg.shared_noise:
            return torch.stack([torch.randn(shape, generator=self.keyed_generator(g, k, 43)) for g in groups.tolist()])
        return torch.stack([torch.randn(shape, generator=self.keyed_generator(g, m, k, 43))
                            for g, m in zip(groups.tolist(), members)])

    def plan(self, batch: StepBatch, generator: torch.Generator) -> Plan:
        """Per epoch, ``train_timesteps`` grid steps drawn alike on every rank, trained over every block of
        whole groups in one optimiser step (or one each, :func:`optimiser_steps`); each unit weighted by the
        step's samples × timesteps; reference losses and, for clipping, the old losses (under the moving
        average, or the sampling weights) computed here once."""
        tc = self.tcfg
        last = min(tc.last_step, batch.chunks[0].num_steps - 1)
        members, seen = [], {}
        for g in batch.groups.tolist():
            members.append(seen.get(g, 0))
            seen[g] = members[-1] + 1
        total = self.total(sum(len(c) for c in batch.chunks))
        steps = []
        drawn = [torch.randperm(last + 1, generator=generator)[: tc.train_timesteps].tolist()
                 for _ in range(tc.inner_epochs)]
        for ks in optimiser_steps(drawn, tc.step_per):
            units = []
            for k in ks:
                for chunks in group_blocks(batch):
                    x0, cond, groups = self.block(batch, chunks)
                    start = sum(len(c) for c in batch.chunks[: chunks[0]])
                    eps = self.noise(groups, members[start : start + len(x0)], k, x0.shape[1:]).to(x0, non_blocking=True)
                    level = self.level(batch, chunks[0], k)
                    sigma = level[0]
                    x_t, target = (1 - sigma) * x0 + sigma * eps, eps - x0
                    with torch.no_grad(), self.policy.adapter_disabled():
                        v_ref = self.velocity(level, x_t, cond, tc.reference_guidance)
                    units.append(GroupUnit(chunks, k, eps, per_sample_mean((v_ref - target) ** 2),
                                           v_ref if tc.beta > 0 else None, None, total * len(ks)))
            steps.append(units)
        if tc.clip_range > 0:  # the old losses, under the average (swapped in once) or the sampling weights
            with torch.no_grad(), (self.average.swapped_in() if self.average is not None else nullcontext()):
                steps = [[replace(u, d_old=self.denoising_loss(batch, u)) for u in units] for units in steps]
        return Plan(steps, global_weights=True)

    def loss(self, batch: StepBatch, unit: GroupUnit) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        tc = self.tcfg
        x_t, target, cond = self.noised(batch, unit)
        groups = self.block(batch, unit.chunks)[2]
        v = self.velocity(self.level(batch, unit.chunks[0], unit.k), x_t, cond, 1.0)
        d = per_sample_mean((v - target) ** 2)
        adv = torch.cat(batch.per_chunk(batch.advantages)[unit.chunks[0] : unit.chunks[-1] + 1]).to(d, non_blocking=True)
        info: dict[str, torch.Tensor] = {"dsm": d.detach().mean()}
        if unit.d_old is not None:
            d, clipped = clipped_denoising_loss(d, unit.d_old.to(d), adv, tc.clip_range)
            info["clip_frac"] = clipped.float().mean()
        _, local = torch.unique(groups, return_inverse=True)
        per_sample = dgpo_loss(d, unit.d_ref.to(d), adv, local, tc.dpo_beta, tc.group_size)
        loss = per_sample.sum() / unit.total
        info["policy_loss"] = per_sample.detach().mean()
        if unit.v_ref is not None:
            kl = per_sample_mean((v - unit.v_ref.to(v)) ** 2)
            loss = loss + tc.beta * kl.sum() / unit.total
            info["kl"] = kl.detach().mean()
        return loss, info

    def finish(self, batch: StepBatch, steps: list[dict[str, list[float]]]) -> dict[str, float]:
        """Move the average after the batch's optimiser steps, ``φ ← d·φ + (1−d)·θ`` with the authors'
        ``d = min(old_decay, 0.001·s)``, s the optimiser steps taken before the batch's last one (their
        ``global_step`` at its update)."""
        if self.average is None:
            return {}
        self.average.decay = ramped_decay((self.step + 1) * self.steps_per_batch() - 1, self.tcfg.old_decay)
        self.average.update()
        return {"old_decay": self.average.decay}

    def state_dict(self) -> dict[str, Any]:
        return {} if self.average is None else {f"average.{k}": v for k, v in self.average.state_dict().items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.average is None:
            return
        saved = {k.removeprefix("average."): state[f"average.{k}"] for k in self.average.state_dict()}
        self.average.load_state_dict(self.parallel.place_like(saved, self.average.state_dict()))
