"""Self-distillation toward a behaviour policy φ: what DiffusionOPSD and DiffusionNFT share
(``docs/methods/diffusion_opsd.md``).

One outer iteration: ODE rollouts with the behaviour weights φ (no grad), rewards and advantages (the
loop's), a reward weight ``r = clip(A, ±A_max)/(2·A_max) + 1/2`` per sample, fixed fitting targets built
once under φ (:meth:`SelfDistillTrainer.fit_units`, one fit unit per backward pass), ``fit_steps``
optimiser updates on them (which units each update takes: :meth:`SelfDistillTrainer.fit_schedule`, every
unit by default; the loss of a unit: :meth:`SelfDistillTrainer.fit_loss`, averaged over the update's kept
(sample, unit) pairs), then the behaviour refresh ``φ ← λ_s·φ + (1−λ_s)·θ`` with ``λ_s = min(rate·s, cap)``,
s counting optimiser steps (:meth:`SelfDistillTrainer.refresh_lambda`). Mirrored velocities around ``v_φ``:

    v⁺ = β·v_θ + (1−β)·v_φ,   v⁻ = (1+β)·v_φ − β·v_θ

Samples with an invalid reward are left out of the fit (not trained at r = ½). φ and s are the
trainer's state (saved in every checkpoint).
"""

from __future__ import annotations

import dataclasses
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
from pydantic import Field

from flowalign.limits import MAX_COEFFICIENT, MAX_GROUP_SIZE, MAX_GUIDANCE, MAX_LR, MAX_TRAIN_STEPS, MAX_UPDATES
from flowalign.sampling import Rollout
from flowalign.trainers.copies import WeightCopy
from flowalign.trainers.base import GroupTrainer, GroupTrainerConfig, Plan, StepBatch
from flowalign.trainers.parts.negative_aware import reward_weight
from flowalign.trainers.parts.reductions import masked_mean
from flowalign.weight_swap import swapped_in


class SelfDistillConfig(GroupTrainerConfig):
    """Options DiffusionOPSD and DiffusionNFT share ([code] defaults; scale the group down on tiny models)."""

    lr: float = Field(3e-4, gt=0, le=MAX_LR)
    group_size: int = Field(24, ge=2, le=MAX_GROUP_SIZE)
    advantage: str = Field("global_std", pattern="^(group|global_std|per_reward|gdpo|win_rate)$")
    #: A_max: advantages are clipped to ±A_max and mapped to r = A/(2·A_max) + 1/2
    adv_clip: float = Field(5.0, gt=0, le=MAX_COEFFICIENT)
    #: the method page's β of the mirrored velocities v± (0.1 for a 3-reward mix); not named ``beta``, which
    #: flowalign reads as a KL-to-reference weight (refused with full fine-tuning)
    mirror_beta: float = Field(1.0, gt=0, le=MAX_COEFFICIENT)
    #: K optimiser updates per outer iteration on its fixed targets
    fit_steps: int = Field(1, ge=1, le=MAX_UPDATES)
    #: λ_s = min(behaviour_rate·s, behaviour_max), s = optimiser steps so far
    behaviour_rate: float = Field(0.001, ge=0, le=MAX_COEFFICIENT)
    behaviour_max: float = Field(0.5, ge=0, le=1)
    #: the separate EMA of θ used for evaluation and checkpoints
    ema_decay: float = Field(0.9, ge=0, lt=1)
    ema_every: int = Field(1, ge=1, le=MAX_TRAIN_STEPS)
    #: CFG scale of every velocity the fit reads (v_θ, v_φ and, for OPSD, the anchor's). None: the
    #: rollout's scale (OPSD's paper: "same CFG as the rollout"); 1.0: the conditional velocity alone, so the
    #: unconditional branch is not pushed through the CFG formula (NFT's default;
    #: docs/results.md). Rollouts keep their CFG either way.
    fit_guidance: float | None = Field(None, ge=1.0, le=MAX_GUIDANCE)


# ---------------------------------------------------------------------------------------------- pieces


class BehaviourWeights:
    """φ: a second set of the trainable tensors (the LoRA adapter, or the full weights of a tiny model),
    swapped into the live parameters when the behaviour policy runs — no second model copy."""

    def __init__(self, params: list[torch.nn.Parameter]):
        self.params = list(params)
        self.tensors = [p.detach().clone() for p in self.params]

    def swapped_in(self) -> AbstractContextManager[None]:
        """The live parameters hold φ inside (θ is restored after, even on error)."""
        return swapped_in(self.params, self.tensors)

    @torch.no_grad()
    def refresh(self, lam: float) -> None:
        """``φ ← λ·φ + (1−λ)·θ`` (λ = 0 copies θ exactly)."""
        for phi, p in zip(self.tensors, self.params):
            if lam == 0:
                phi.copy_(p.detach())
            else:
                phi.mul_(lam).add_(p.detach(), alpha=1 - lam)


def behaviour_lambda(step: int, rate: float, cap: float, flat: int = 0) -> float:
    """``λ_s = min(rate·(s − flat), cap)``, and 0 for ``s < flat`` (a behaviour policy that copies θ for the
    first ``flat`` optimiser steps) [code]."""
    return 0.0 if step < flat else min(rate * (step - flat), cap)


@dataclass
class FitUnit:
    """What one θ-phase backward pass needs, computed once per outer iteration under φ (all detached).

    ``total``: kept (sample, unit) pairs of the whole batch, the mean's denominator (set by the plan).
    """

    chunk: Rollout
    r: torch.Tensor  # (B,)
    keep: torch.Tensor  # (B,) bool: samples with a valid reward
    tensors: dict[str, Any]
    total: int = 1


# ---------------------------------------------------------------------------------------------- hooks


class SelfDistillTrainer(GroupTrainer):
    """The hooks OPSD and NFT share: φ-rollouts, targets under φ, K fitting updates, behaviour refresh.

    Subclasses define :meth:`fit_units` (φ phase of one chunk, no parameter gradient → fit units) and
    :meth:`fit_loss` (θ phase of one unit: per-sample loss ``(B,)``).
    """

    Config = SelfDistillConfig
    tcfg: SelfDistillConfig
    sampler = "ode"

    @classmethod
    def weight_copies(cls, cfg, tcfg) -> list[WeightCopy]:
        """The behaviour weights φ, a copy of the trained tensors."""
        return [WeightCopy("behaviour")]

    def __init__(self, *args: Any, **kw: Any):
        super().__init__(*args, **kw)
        self.check_rewards()
        self.behaviour = BehaviourWeights(self.params)
        #: s of λ_s: optimiser steps so far (trainer state)
        self.optimizer_steps = 0

    def check_rewards(self) -> None:
        """Refuse rewards the method cannot use, before any compute is spent (NFT takes any)."""

    def collect(self, step: int) -> StepBatch:
        """The loop's batch, rolled out with the behaviour weights φ."""
        with self.behaviour.swapped_in():
            return super().collect(step)

    def plan(self, batch: StepBatch, generator: torch.Generator) -> Plan:
        """Targets under φ once, then ``fit_steps`` optimiser steps over the units :meth:`fit_schedule` gives
        each (every rank steps, even one whose samples were all invalid). A global plan: each chunk draws
        from a generator keyed by its identity, and a step's mean runs over every rank's kept samples in it."""
        valid = batch.scores.valid
        r_all = reward_weight(batch.advantages.float(), self.tcfg.adv_clip)
        with self.behaviour.swapped_in():
            units = [self.fit_units(c, r, ok, self.keyed_generator(*key, 23))
                     for c, key, r, ok in zip(batch.chunks, batch.chunk_keys(), batch.per_chunk(r_all),
                                              batch.per_chunk(valid))]
        steps = [[u for u in step if u.keep.any()] for step in self.fit_schedule(batch, units, generator)]
        totals = [self.total(sum(int(u.keep.sum()) for u in step)) for step in steps]
        steps = [[dataclasses.replace(u, total=total) for u in step] for step, total in zip(steps, totals)]
        r_mean = r_all[valid].mean().item() if valid.any() else float("nan")
        return Plan(steps, {"r_mean": r_mean}, global_weights=True)

    def fit_schedule(self, batch: StepBatch, units: list[list[FitUnit]],
                     generator: torch.Generator) -> list[list[FitUnit]]:
        """The units of each of the ``fit_steps`` optimiser steps, from ``units[i]``, those of
        ``batch.chunks[i]`` (``generator``: the same on every rank). Default: every unit in every step."""
        return [[u for chunk in units for u in chunk]] * self.tcfg.fit_steps

    def loss(self, batch: StepBatch, unit: FitUnit) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        per_sample, info = self.fit_loss(unit)
        # the kept samples masked, not indexed: no host wait
        keep = unit.keep.to(per_sample.device, non_blocking=True)
        kept = torch.where(keep, per_sample, 0.0)
        return kept.sum() / unit.total, {**info, "loss": masked_mean(per_sample.detach(), keep)}

    def finish(self, batch: StepBatch, steps: list[dict[str, list[float]]]) -> dict[str, float]:
        """``φ ← λφ + (1−λ)θ`` once the fitting updates are done."""
        self.optimizer_steps += self.tcfg.fit_steps
        lam = self.refresh_lambda(self.optimizer_steps)
        self.behaviour.refresh(lam)
        return {"behaviour_lambda": lam}

    def refresh_lambda(self, step: int) -> float:
        """λ of the refresh after ``step`` optimiser steps: ``min(behaviour_rate·s, behaviour_max)``."""
        return behaviour_lambda(step, self.tcfg.behaviour_rate, self.tcfg.behaviour_max)

    def state_dict(self) -> dict[str, Any]:
        """φ's tensors by parameter name, and s."""
        names = [n for n, p in self.policy.trainable.named_parameters() if p.requires_grad]
        return {**dict(zip(names, self.behaviour.tensors)), "optimizer_steps": self.optimizer_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """φ as saved, laid out like the live copy (under fsdp: this rank's shards), and s."""
        names = [n for n, p in self.policy.trainable.named_parameters() if p.requires_grad]
        live = dict(zip(names, self.behaviour.tensors))
        saved = self.parallel.place_like({k: state[k] for k in live if k in state}, live)
        with torch.no_grad():
            for name, phi in saved.items():
                live[name].copy_(phi)
        self.optimizer_steps = int(state.get("optimizer_steps", 0))

    def fit_units(self, chunk: Rollout, r: torch.Tensor, keep: torch.Tensor, generator: torch.Generator) -> list[FitUnit]:
        """The fixed targets of one chunk under φ (one unit per backward pass)."""
        raise NotImplementedError

    def fit_loss(self, unit: FitUnit) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Per-sample loss ``(B,)`` of one unit, and scalars to log (0-dim tensors or floats)."""
        raise NotImplementedError

    def fit_guidance(self, chunk: Rollout) -> float:
        """The CFG scale of the velocities the fit reads (``trainer.fit_guidance``, else the rollout's)."""
        return chunk.guidance_scale if self.tcfg.fit_guidance is None else self.tcfg.fit_guidance
