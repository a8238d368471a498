"""Advantage Weighted Matching (AWM, arXiv 2509.25050; ``docs/methods/awm.md``).

SA-Solver rollouts (the authors' sampler, ``rollout_solver: sa_solver``; ``euler``: the policy's ODE), the
loop's advantages, then the pretraining loss on the rollouts' own endpoints: each endpoint ``x0`` is
re-noised at ``train_timesteps`` steps of the policy's grid (one per stratum of the first
``timestep_fraction`` of it; the samples of a shuffled micro-batch share one draw, as the authors'),
``x_t = (1−t)·x0 + t·ε``, and with ``ℓ = −w(t)·mean(v_θ(x_t) − (ε − x0))²``

    Â = clip(A, ±A_clip)·A_max/A_clip,   r = exp(ℓ − ℓ_old)
    L = mean_{i,t} max(−Â_i·r, −Â_i·clip(r, 1−ε, 1+ε)) + β·mean_{i,t} λ(t)·mean(v_θ − v_ref)²
                                                        + β_ema·mean_{i,t} λ(t)·mean(v_θ − v_ema)²

(λ = 1, or the authors' "ELBO" weight 1/(2·std(t)²), ``kl_weight`` / ``ema_kl_weight``).

On-policy (one optimiser step per batch) ``ℓ_old = sg(ℓ)``, so r = 1 and ∇L = mean Â·∇MSE: the
flow-matching loss weighted by the advantage. v_ref runs the starting weights; v_ema an exponential moving
average of the trained tensors, moved after each batch's optimiser steps, ``φ ← d·φ + (1−d)·θ`` with
``d = min(ema_kl_decay, 0.001·s)`` after s optimiser steps (the authors' adaptive KL regulariser).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Sequence

import torch
from pydantic import Field

from flowalign.ema import EMA
from flowalign.limits import MAX_BATCH, MAX_COEFFICIENT, MAX_GUIDANCE, MAX_LR, MAX_SAMPLING_STEPS
from flowalign.sampling.sa_solver import SASolver
from flowalign.trainers.options import EpochOptions, ReferenceOptions
from flowalign.trainers.copies import WeightCopy, full_reference
from flowalign.trainers.base import GroupTrainer, GroupTrainerConfig, Plan, StepBatch
from flowalign.trainers.parts.global_plan import ChunkRef, global_plan
from flowalign.trainers.parts.policy_average import ramped_decay
from flowalign.trainers.parts.policy_gradient import ppo_clip_loss
from flowalign.trainers.parts.reductions import per_sample_mean


class AWMConfig(GroupTrainerConfig, EpochOptions, ReferenceOptions):
    name: Literal["awm"] = "awm"
    #: what runs saved before these options existed computed (see TrainerConfig.before)
    before = {"ema_kl_beta": 0.0, "rollout_solver": "euler", "step_draw": "rollout_batch", "zero_advantage": "skipped"}
    #: the rollouts' sampler: "sa_solver" (the authors': SA-Solver, PEC, orders 2, τ = rollout_noise_level on
    #: the steps that end at t in [0.3, 0.9]) or "euler" (the policy's ODE)
    rollout_solver: Literal["sa_solver", "euler"] = "sa_solver"
    #: τ of the SA-Solver rollouts (the authors' ``sample.noise_level``: 0.4 for GenEval and OCR, 0 for PickScore)
    rollout_noise_level: float = Field(0.4, ge=0, le=10)
    lr: float = Field(3e-4, gt=0, le=MAX_LR)
    #: re-noised copies of each endpoint per update, one per stratum of the trained grid steps
    train_timesteps: int = Field(6, ge=1, le=MAX_SAMPLING_STEPS)
    #: grid steps 1 … ⌊fraction·T⌋ are trained (step 0, pure noise, is left out)
    timestep_fraction: float = Field(0.9, gt=0, le=1)
    #: which samples share a draw of grid steps: "micro_batch" (the authors'): each epoch the step's samples
    #: (all ranks') are shuffled and cut into micro-batches of ``step_draw_size``, one draw each;
    #: "rollout_batch": one draw per rollout batch (the former form)
    step_draw: Literal["micro_batch", "rollout_batch"] = "micro_batch"
    #: samples per shuffled micro-batch of ``step_draw: micro_batch`` (the authors' ``train.batch_size``: 3 in
    #: their GenEval and OCR recipes, 2 in PickScore); the last one is smaller when it does not divide the step
    step_draw_size: int = Field(3, ge=1, le=MAX_BATCH)
    #: a rollout batch whose advantages are all 0: "kept" (the authors' loop trains every sample, its filter of
    #: zero-advantage samples commented out, so such samples add their KL terms and count in the mean);
    #: "skipped": left out of the plan (the former form)
    zero_advantage: Literal["kept", "skipped"] = "kept"
    #: w(t) of ℓ: "uniform" (ℓ = −MSE) or "ghuber" (ℓ = −t·(MSE^p − 10⁻¹⁰ᵖ)/p)
    weighting: Literal["uniform", "ghuber"] = "ghuber"
    #: p of the "ghuber" weighting
    ghuber_power: float = Field(0.25, gt=0, le=1)
    clip_range: float = Field(1.0, gt=0, le=MAX_COEFFICIENT)
    #: A_max: advantages are clipped to ±adv_clip and rescaled to ±A_max
    advantage_max: float = Field(1.0, gt=0, le=MAX_COEFFICIENT)
    #: weight of the velocity-space KL to the reference (the adapter switched off / the frozen copy)
    beta: float = Field(0.001, ge=0, le=MAX_COEFFICIENT)
    #: λ(t) of that KL: "uniform" (1) or "elbo" (1/(2·std(t)²), std(t) = 0.7·√(t/(1 − min(t, 0.99)))); the
    #: authors' ``kl_weight``, "Uniform" in every recipe of theirs
    kl_weight: Literal["uniform", "elbo"] = "uniform"
    #: weight of the velocity-space KL to an exponential moving average of the policy (the authors'
    #: ``ema_beta``); 0: no average is kept
    ema_kl_beta: float = Field(1.0, ge=0, le=MAX_COEFFICIENT)
    #: d of that average, moved once per batch ``φ ← d·φ + (1−d)·θ`` (the authors' ``kl_ema_decay``); the
    #: evaluation EMA (``ema_decay``) is a separate one
    ema_kl_decay: float = Field(0.3, ge=0, lt=1)
    #: "linear": d = min(ema_kl_decay, 0.001·s) after s optimiser steps, so the average follows the policy
    #: closely at first (the authors'); "constant": d = ema_kl_decay from the start
    ema_kl_decay_schedule: Literal["linear", "constant"] = "linear"
    #: λ(t) of the KL to the moving average, as ``kl_weight`` (the authors' ``kl_ema_weight``, "Uniform" in
    #: every recipe of theirs)
    ema_kl_weight: Literal["uniform", "elbo"] = "uniform"
    #: CFG scale of v_θ, v_ref and v_ema in the loss; None: the rollout's (the authors train with the sampling CFG)
    fit_guidance: float | None = Field(None, ge=1.0, le=MAX_GUIDANCE)


# ---------------------------------------------------------------------------------------------- the loss


def advantage_weights(adv: torch.Tensor, adv_clip: float, advantage_max: float) -> torch.Tensor:
    """AWM's per-sample weights ``Â = clip(A, ±A_clip)·A_max/A_clip`` ``(B,)``."""
    return adv.clamp(-adv_clip, adv_clip) * (advantage_max / adv_clip)


def matching_log_prob(v: torch.Tensor, target: torch.Tensor, t: float | torch.Tensor, weighting: str,
                      power: float) -> torch.Tensor:
    """``ℓ (B,)``: ``−mean(v − target)²`` ("uniform") or ``−t·((MSE + 10⁻¹⁰)^p − 10⁻¹⁰ᵖ)/p`` ("ghuber");
    ``t`` one level or one per sample ``(B,)``."""
    mse = per_sample_mean((v - target) ** 2)
    if weighting == "uniform":
        return -mse
    if isinstance(t, torch.Tensor):
        t = t.to(mse)
    return -((mse + 1e-10) ** power - 1e-10**power) * t / power


def velocity_kl(v: torch.Tensor, other: torch.Tensor, t: float | torch.Tensor, weight: str) -> torch.Tensor:
    """The KL term per sample ``(B,)``: ``λ(t)·mean(v − other)²`` over each sample's elements, ``λ = 1``
    ("uniform") or ``1/(2·std(t)²)`` with ``std(t) = 0.7·√(t/(1 − min(t, 0.99)))`` ("elbo": the authors'
    ``compute_log_prob_awm`` std, an SDE step's noise scale; the clamp keeps t = 1 finite); ``t`` one level
    or one per sample ``(B,)``."""
    kl = per_sample_mean((v - other) ** 2)
    if weight == "uniform":
        return kl
    sigma = torch.as_tensor(t, dtype=torch.float32, device=kl.device)  # float32, as their scheduler's timesteps
    std = torch.sqrt(sigma / (1 - sigma.clamp(0, 0.99))) * 0.7
    return (kl / (2 * std**2)).to(kl.dtype)


def awm_loss(log_prob: torch.Tensor, old_log_prob: torch.Tensor | None, weights: torch.Tensor, clip_range: float,
             kl: torch.Tensor | None = None, beta: float = 0.0, ema_kl: torch.Tensor | None = None,
             ema_beta: float = 0.0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``mean_i max(−Â_i·r_i, −Â_i·clip(r_i, 1±ε)) + β·mean_i kl_i + β_ema·mean_i ema_kl_i`` with
    ``r = exp(ℓ − ℓ_old)`` (``ℓ_old`` None: on-policy, ``sg(ℓ)``, r = 1 exactly); every argument ``(B,)``,
    ``kl``/``ema_kl`` the per-sample ``mean(v_θ − v_ref)²`` / ``mean(v_θ − v_ema)²``."""
    old = log_prob.detach() if old_log_prob is None else old_log_prob
    per_sample, ratio, clipped = ppo_clip_loss(log_prob, old, weights, clip_range)
    loss = per_sample.mean()
    info = {"policy_loss": loss.detach(), "ratio": ratio.detach().mean(), "clip_frac": clipped.float().mean()}
    if kl is not None and beta > 0:
        loss = loss + beta * kl.mean()
        info["kl"] = kl.detach().mean()
    if ema_kl is not None and ema_beta > 0:
        loss = loss + ema_beta * ema_kl.mean()
        info["ema_kl"] = ema_kl.detach().mean()
    return loss, info


def stratified_steps(num_steps: int, fraction: float, n: int, u: torch.Tensor) -> list[int]:
    """Grid steps to train: stratum s of ``[1, ⌊fraction·T⌋]`` (integer bounds of ``linspace(1, ⌊fT⌋, n+1)``)
    contributes ``lower_s + ⌊u_s·(upper_s − lower_s)⌋``, ``u ~ U[0,1)^n`` (the authors' "discrete_wo_init")."""
    top = max(1, min(num_steps - 1, int(num_steps * fraction)))
    bounds = torch.linspace(1, top, n + 1).long()
    lower, upper = bounds[:-1], bounds[1:]
    return (lower + (u * (upper - lower)).long()).tolist()


def micro_batch_uniforms(perm: torch.Tensor, size: int, u: torch.Tensor) -> torch.Tensor:
    """Each sample's uniforms ``(N, n)`` when the samples, in the order ``perm`` ``(N,)`` puts them, are cut
    into micro-batches of ``size`` (the last one shorter when ``size`` does not divide N) and micro-batch j
    takes row j of ``u`` ``(⌈N/size⌉, n)``: sample ``perm[j·size + r]`` gets ``u[j]``, as the authors'
    loop shuffles its samples, reshapes them into micro-batches and draws once per micro-batch."""
    out = torch.empty(len(perm), u.shape[1], dtype=u.dtype)
    out[perm] = u.repeat_interleave(size, dim=0)[: len(perm)]
    return out


def renoised(x0: torch.Tensor, eps: torch.Tensor, t: float | torch.Tensor) -> torch.Tensor:
    """``x_t = (1−t)·x0 + t·ε`` ``(B, ...)``, ``t`` one level or one per sample ``(B,)``."""
    if isinstance(t, torch.Tensor):
        t = t.to(x0).view(-1, *[1] * (x0.dim() - 1))
    return (1 - t) * x0 + t * eps


# ---------------------------------------------------------------------------------------------- hooks


@dataclass(frozen=True)
class MatchUnit:
    """Chunk ``chunk`` (this rank's index) re-noised at grid steps ``k`` (one per sample) with noise ``eps``;
    ``old``: ℓ under the sampling weights (None on-policy); one of ``of`` units of optimiser step ``update``."""

    chunk: int
    k: tuple[int, ...]
    eps: torch.Tensor
    old: torch.Tensor | None
    of: int
    update: int


def sample_keys(batch: StepBatch) -> list[tuple[int, int]]:
    """``(group, member)`` of every sample of the batch, in batch order (its identity in any rank layout)."""
    seen: dict[int, int] = {}
    keys = []
    for g in batch.groups.tolist():
        keys.append((g, seen.get(g, 0)))
        seen[g] = keys[-1][1] + 1
    return keys


class AWMTrainer(GroupTrainer):
    Config = AWMConfig
    tcfg: AWMConfig

    @property
    def sampler(self) -> SASolver | str:  # type: ignore[override]
        return SASolver(self.tcfg.rollout_noise_level) if self.tcfg.rollout_solver == "sa_solver" else "ode"

    @classmethod
    def weight_copies(cls, cfg, tcfg) -> list[WeightCopy]:
        """The starting weights (full fine-tuning with β > 0) and the KL's moving average of the trained
        tensors (β_ema > 0), run swapped into the live parameters."""
        reference = full_reference(tcfg) if tcfg.beta > 0 and cfg.model.finetune == "full" else []
        return reference + ([WeightCopy("snapshot")] if tcfg.ema_kl_beta > 0 else [])

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        #: φ: the moving average v_ema runs (the starting trained tensors until the first batch is trained)
        self.kl_ema = EMA(self.params, self.tcfg.ema_kl_decay) if self.tcfg.ema_kl_beta > 0 else None
        self.grids: dict[int, list[float]] = {}

    def guidance(self, chunk) -> float:
        return chunk.guidance_scale if self.tcfg.fit_guidance is None else self.tcfg.fit_guidance

    def plan(self, batch: StepBatch, generator: torch.Generator) -> Plan:
        """Global, as Flow-GRPO's (:func:`global_plan`): per epoch the chunks (under ``zero_advantage: skipped``
        only those with a non-zero advantage) in ``updates_per_epoch`` optimiser steps, each chunk × its ``train_timesteps`` re-noised copies. The
        grid steps' draws (per shuffled micro-batch of all ranks' samples, or per chunk) and every sample's
        noise come from generators keyed by the step, the epoch and the samples' identities, so any rank
        layout draws the same. With more than one optimiser step, ℓ_old is taken now, under the sampling
        weights."""
        n = self.tcfg.train_timesteps
        adv = batch.per_chunk(batch.advantages)
        kept = self.tcfg.zero_advantage == "kept"
        local = [ChunkRef(key, self.rank, i, kept or bool(adv[i].abs().sum() > 0), tuple(range(n)))
                 for i, key in enumerate(batch.chunk_keys())]
        gathered = self.gather_objects((local, sample_keys(batch)))
        chunks = [c for refs, _ in gathered for c in refs]
        # every rank's samples in one order whatever the layout: the micro-batches' shuffle permutes these
        everyone = sorted(k for _, keys in gathered for k in keys)
        steps = global_plan(chunks, self.tcfg.inner_epochs, self.tcfg.updates_per_epoch, generator,
                            lambda c, e: list(c.steps))
        keys = batch.per_chunk(torch.tensor(sample_keys(batch)))
        off_policy = len(steps) > 1
        draws: dict[tuple[int, int], tuple[list[tuple[int, ...]], torch.Tensor]] = {}
        shared: dict[int, dict[tuple[int, int], torch.Tensor]] = {}
        plan = []
        for update, pairs in enumerate(steps):
            units = []
            for c, s in pairs:
                if c.rank != self.rank:
                    continue
                epoch = update // self.tcfg.updates_per_epoch
                if self.tcfg.step_draw == "micro_batch" and epoch not in shared:
                    shared[epoch] = self.micro_batch_draw(everyone, epoch)
                if (c.index, epoch) not in draws:
                    draws[c.index, epoch] = self.draws(batch, c.index, keys[c.index], epoch, shared.get(epoch))
                ks, eps = draws[c.index, epoch]
                old = self.log_prob(batch, c.index, ks[s], eps[:, s]).detach() if off_policy else None
                units.append(MatchUnit(c.index, ks[s], eps[:, s], old, len(pairs), update))
            plan.append(units)
        return Plan(plan, global_weights=True)

    def micro_batch_draw(self, everyone: list[tuple[int, int]], epoch: int) -> dict[tuple[int, int], torch.Tensor]:
        """Each sample's uniforms ``(n,)`` of epoch ``epoch`` under ``step_draw: micro_batch``: the step's
        samples ``everyone`` (sorted identities) shuffled and cut into micro-batches of ``step_draw_size``,
        one draw of ``train_timesteps`` uniforms each (:func:`micro_batch_uniforms`). The authors shuffle
        each rank's own samples with the global RNG; here the shuffle spans the ranks and comes from
        generators keyed by (seed, step, epoch), so every rank, in any layout, draws the same."""
        size, n = self.tcfg.step_draw_size, self.tcfg.train_timesteps
        perm = torch.randperm(len(everyone), generator=self.keyed_generator(epoch, 43))
        u = torch.rand((-(-len(everyone) // size), n), generator=self.keyed_generator(epoch, 47))
        return dict(zip(everyone, micro_batch_uniforms(perm, size, u), strict=True))

    def draws(self, batch: StepBatch, i: int, keys: torch.Tensor, epoch: int,
              shared: dict[tuple[int, int], torch.Tensor] | None = None) -> tuple[list[tuple[int, ...]], torch.Tensor]:
        """Chunk ``i``'s trained grid steps, stratum by stratum one per sample, and each sample's noises
        ``(B, n, ...)``. ``shared``: each sample's uniforms (its micro-batch's draw); None: one draw for the
        chunk, keyed by its first sample (``step_draw: rollout_batch``)."""
        chunk, n = batch.chunks[i], self.tcfg.train_timesteps
        if shared is None:
            g, m = keys[0].tolist()
            u = torch.rand(n, generator=self.keyed_generator(g, m, epoch, 37))
            per_sample = [stratified_steps(chunk.num_steps, self.tcfg.timestep_fraction, n, u)] * len(keys)
        else:
            per_sample = [stratified_steps(chunk.num_steps, self.tcfg.timestep_fraction, n, shared[tuple(key.tolist())])
                          for key in keys]
        ks = [tuple(row[s] for row in per_sample) for s in range(n)]
        shape = chunk.final_latents.shape[1:]
        eps = torch.stack([torch.randn((n, *shape), generator=self.keyed_generator(*key.tolist(), epoch, 41))
                           for key in keys])
        return ks, eps

    def velocity(self, batch: StepBatch, i: int, k: int | Sequence[int],
                 eps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float | torch.Tensor]:
        """``v_θ`` at the re-noised endpoints of chunk ``i`` (grid step ``k``, or one per sample), the target
        ``ε − x0`` and t (a float when the samples share it, else ``(B,)``)."""
        chunk = batch.chunks[i]
        x0 = chunk.final_latents.to(self.policy.device, non_blocking=True)
        eps = eps.to(x0, non_blocking=True)
        t = self.level(chunk.num_steps, k)
        x_t = renoised(x0, eps, t)
        return self.policy.velocity(x_t, t, chunk.cond, self.guidance(chunk)), eps - x0, t

    def level(self, num_steps: int, k: int | Sequence[int]) -> float | torch.Tensor:
        """σ of grid step ``k``: a float when every sample has the same step (the rollout batch's draw), else
        one per sample ``(B,)`` float32 (a micro-batch's draw may differ from its neighbours')."""
        grid = self.grid(num_steps)
        if isinstance(k, int) or len(set(k)) == 1:
            return grid[k if isinstance(k, int) else k[0]]
        return torch.tensor([grid[j] for j in k], dtype=torch.float32)

    def grid(self, num_steps: int) -> list[float]:
        """The policy's own σ grid, where the authors re-noise (their scheduler's timesteps); an SA-Solver
        rollout ran on a copy with its first and second-last points moved."""
        if num_steps not in self.grids:
            self.grids[num_steps] = self.policy.sigmas(num_steps).float().tolist()
        return self.grids[num_steps]

    def log_prob(self, batch: StepBatch, i: int, k: tuple[int, ...], eps: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            v, target, t = self.velocity(batch, i, k, eps)
        return matching_log_prob(v, target, t, self.tcfg.weighting, self.tcfg.ghuber_power)

    def filler(self, batch: StepBatch, update: int) -> MatchUnit:
        shape = batch.chunks[0].final_latents.shape
        return MatchUnit(0, (1,) * shape[0], torch.zeros(shape), None, 1, update)

    def loss(self, batch: StepBatch, unit: MatchUnit) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        chunk = batch.chunks[unit.chunk]
        ema_kl = None
        if self.kl_ema is not None:  # before v_θ: the swap writes into the parameters v_θ's graph keeps
            with torch.no_grad(), self.kl_ema.swapped_in():
                v_ema = self.velocity(batch, unit.chunk, unit.k, unit.eps)[0]
        v, target, t = self.velocity(batch, unit.chunk, unit.k, unit.eps)
        if self.kl_ema is not None:
            ema_kl = velocity_kl(v, v_ema, t, self.tcfg.ema_kl_weight)
        log_prob = matching_log_prob(v, target, t, self.tcfg.weighting, self.tcfg.ghuber_power)
        adv = batch.per_chunk(batch.advantages)[unit.chunk].to(v, non_blocking=True)
        weights = advantage_weights(adv, self.tcfg.adv_clip, self.tcfg.advantage_max)
        kl = None
        if self.tcfg.beta > 0:
            x0 = chunk.final_latents.to(v, non_blocking=True)
            x_t = renoised(x0, unit.eps.to(v, non_blocking=True), t)
            with torch.no_grad(), self.policy.adapter_disabled():
                v_ref = self.policy.velocity(x_t, t, chunk.cond, self.guidance(chunk))
            kl = velocity_kl(v, v_ref, t, self.tcfg.kl_weight)
        old = None if unit.old is None else unit.old.to(log_prob)
        loss, info = awm_loss(log_prob, old, weights, self.tcfg.clip_range, kl, self.tcfg.beta, ema_kl,
                              self.tcfg.ema_kl_beta)
        info["mse"] = per_sample_mean((v.detach() - target) ** 2).mean()
        return loss / unit.of, info

    def finish(self, batch: StepBatch, steps: list[dict[str, list[float]]]) -> dict[str, float]:
        """``φ ← d·φ + (1−d)·θ`` once the batch's optimiser steps are done, as the authors move it after each
        of their epochs (one step's rollouts and its update); s counts ``inner_epochs × updates_per_epoch``
        optimiser steps a batch (their global_step: one a batch in their recipes)."""
        if self.kl_ema is None:
            return {}
        steps = (self.step + 1) * self.tcfg.inner_epochs * self.tcfg.updates_per_epoch
        self.kl_ema.decay = ramped_decay(steps, self.tcfg.ema_kl_decay, self.tcfg.ema_kl_decay_schedule)
        self.kl_ema.update()
        return {"ema_kl_decay": self.kl_ema.decay}

    def trained_names(self) -> list[str]:
        return [n for n, p in self.policy.trainable.named_parameters() if p.requires_grad]

    def state_dict(self) -> dict[str, Any]:
        """φ's tensors by parameter name."""
        if self.kl_ema is None:
            return {}
        return {f"ema_kl.{n}": s for n, s in zip(self.trained_names(), self.kl_ema.shadow, strict=True)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """φ as saved, laid out like the live average (under fsdp: this rank's shards)."""
        live = self.state_dict()
        saved = self.parallel.place_like({k: state[k] for k in live}, live)
        with torch.no_grad():
            for k, s in live.items():
                s.copy_(saved[k])
