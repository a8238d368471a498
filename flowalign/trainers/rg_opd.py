"""RG-OPD: reward-gradient on-policy distillation, with CoRe reward refits (``docs/methods/rg_opd.md``).

Guanys-dar/latent-reward-register's training unit (``rgopd.py`` @ 16028b7, ``guidance.py`` @ c22b65e,
``rollout.py``, ``teacher.py``, ``flowmatch.py``). Each step θ_old rolls out with the ODE sampler; at each
visited state ``(x_σ, σ)`` of the first ``optimized_steps`` steps (default: all but the last, their 9 of 10):

    v_b = v_ref(x_σ)  (the frozen starting weights: their ``anchor: frozen_reference``; or θ_old's, ``target_base``)
    g   = ∇_x r_ψ(x_σ, σ, c)                          only where σ > active_sigma_min (else v* = v_b)
    v*  = sg(v_b − κ·rms(v_b)·g/rms(g))                (``flowalign.sampling.guidance.reward_correction``)
    L   = mean((x + dt·v_θ − (x + dt·v*))²) / 2s²      dt = σ' − σ: their ``rgopd_loss`` on the Euler step's
                                                       next state (``loss_space``), transition std s = 1 or
                                                       η·|dt| (``transition_noise``, their ``noise_level``)
       (+ anchor_weight·mean‖v_θ − v_ref‖², not in their code; 0 by default)

One optimiser step per visited-state index over the whole rollout batch, in trajectory order (their
rollout loop; ``updates: per_batch`` puts every state in one step), ``inner_steps`` passes.

CoRe (``trainer.core``, not in their code): every ``core.every`` steps the registers are refit with
``L_RM = L_BT(real pairs) + μ·L_BT(generated pairs) + anchor_weight·mean(r_ψ − r_ψ,prev)²``, so the generator
cannot walk off the latent reward's support. The generated pairs are the generator's own samples of the
last ``core.buffer_steps`` steps, paired within prompt groups by the pixel reward in ``rewards:``.
The loop is the shared one; the hooks: ODE rollouts keeping their velocities (``sampling``), the latent
score logged (``collect``), the targets built once per batch and the optimiser steps on them (``plan``,
``loss``), the CoRe refit (``finish``), and the refit reward and pair buffer as the trainer's state.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Mapping
from typing import Any, ClassVar, Literal

import numpy as np
import torch
from pydantic import Field, field_validator, model_validator

from flowalign.config import Section
from flowalign.errors import UserError
from flowalign.limits import (
    MAX_BATCH,
    MAX_COEFFICIENT,
    MAX_GROUP_SIZE,
    MAX_LR,
    MAX_SAMPLING_STEPS,
    MAX_TRAIN_STEPS,
    MAX_UPDATES,
)
from flowalign.paths import REPO_ROOT
from flowalign.sampling import Rollout, load_latent_reward
from flowalign.sampling.guidance import (
    guide_velocity,
    guiding_gradient,
    latent_reward_sizes,
    per_sample_rms,
)
from flowalign.trainers.base import (
    GroupTrainer,
    Plan,
    Sampling,
    StepBatch,
    derived_seed,
)
from flowalign.trainers import unit_logs
from flowalign.trainers.copies import WeightCopy, full_reference
from flowalign.trainers.options import ReferenceOptions, RolloutOptions, TrainerConfig
from flowalign.trainers.parts.latent_preference import PreferencePairs, fit
from flowalign.trainers.parts.rewarded_rollouts import rewarded_rollouts


class CoReConfig(Section):
    """``trainer.core``: co-evolving latent reward refits."""

    #: refit the registers after every N generator steps
    every: int = Field(5, ge=1, le=MAX_TRAIN_STEPS)
    #: Bradley-Terry minibatch steps per refit
    steps: int = Field(20, ge=1, le=MAX_UPDATES)
    batch_size: int = Field(16, ge=1, le=MAX_BATCH)
    lr: float = Field(1e-3, gt=0, le=MAX_LR)
    #: weight μ of the generator's own pairs (labelled by the pixel reward)
    mu: float = Field(0.5, ge=0, le=MAX_COEFFICIENT)
    #: weight of mean (r_ψ − r_ψ,prev)² on the real pairs (prev: the reward before this refit)
    anchor_weight: float = Field(1.0, ge=0, le=MAX_COEFFICIENT)
    #: real preference pairs (default: pairs.safetensors in the latent reward folder)
    real_pairs: str | None = None
    #: a generated pair needs this pixel-reward margin
    min_margin: float = Field(1e-6, ge=0, le=MAX_COEFFICIENT)
    #: refits learn from the generated pairs of the last N generator steps (default: ``every``, i.e. every
    #: step since the previous refit); a longer buffer gives each refit more pairs from more prompts
    buffer_steps: int | None = Field(None, ge=1, le=MAX_UPDATES)

    @model_validator(mode="before")
    @classmethod
    def _former_anchor(cls, data: Any) -> Any:
        if isinstance(data, dict) and "anchor" in data:
            raise ValueError("trainer.core.anchor is now trainer.core.anchor_weight (same meaning: the weight of "
                             "staying near the previous reward)")
        return data


class RGOPDConfig(TrainerConfig, RolloutOptions, ReferenceOptions):
    """The loop's group rollouts (their rewards are logged and label CoRe's pairs; no advantages)."""

    refused: ClassVar[dict[str, str]] = {"anchor": "RG-OPD's anchor weight is now trainer.anchor_weight (same meaning, the name Flow-OPD "
                         "gives its anchor term's weight)"}

    name: Literal["rg_opd"] = "rg_opd"
    #: what runs saved before these options existed computed (see TrainerConfig.before)
    before = {"target_base": "rollout", "active_sigma_min": 0.0, "loss_space": "velocity", "updates": "per_batch"}
    #: latent reward folder (flowalign train-reward)
    latent_reward: str
    #: the latent reward's heads whose gradients the target follows, each normalised then weighted by
    #: ``head_weights`` (default 1) and summed (the authors' ``combine``; their SD3 preset: [preference]);
    #: null: the reward's score (its first head)
    heads: list[str] | None = Field(None, min_length=1)
    #: weight of each named head's normalised gradient in the sum (a head not named here: 1)
    head_weights: dict[str, float] | None = None
    #: κ, the authors' ``reward_scale``: the target moves each velocity by κ·rms(v_b) along −∇r (their SD3
    #: preset 0.4, FLUX 0.8)
    kappa: float = Field(0.4, ge=0, le=MAX_COEFFICIENT)
    #: the velocity the reward correction is added to: ``reference`` the frozen starting weights (the adapter
    #: switched off, or a full fine-tune's frozen copy; the authors' ``anchor: frozen_reference``), or
    #: ``rollout`` θ_old's velocity kept from the rollout
    target_base: Literal["reference", "rollout"] = "reference"
    #: the reward corrects the target only where σ > this (the authors' ``active_sigma_min`` 0.2; 0: every step)
    active_sigma_min: float = Field(0.2, ge=0, le=1)
    #: ``transition``: mean((dt·(v_θ − v*))²)/2, the authors' loss on the Euler step's next state;
    #: ``velocity``: mean(v_θ − v*)²
    loss_space: Literal["transition", "velocity"] = "transition"
    #: η, the authors' ``noise_level``: the transition loss divides by 2·std² with std = max(η·|dt|, 1e-6), the
    #: step's KL to a Gaussian transition of that width (0: a deterministic step, std 1, their presets)
    transition_noise: float = Field(0.0, ge=0, le=MAX_COEFFICIENT)
    #: distil the first N rollout steps (default: all but the last, the authors' 9 of 10)
    optimized_steps: int | None = Field(None, ge=1, le=MAX_SAMPLING_STEPS)
    #: ``per_state``: one optimiser step per visited-state index over the whole batch, in trajectory order
    #: (the authors' loop); ``per_batch``: every visited state in one optimiser step
    updates: Literal["per_state", "per_batch"] = "per_state"
    #: passes of the plan's optimiser steps on one rollout batch before θ_old ← θ
    inner_steps: int = Field(1, ge=1, le=MAX_UPDATES)
    #: visited states distilled per chunk: a random subset of this many optimised steps (0: every one)
    steps_per_chunk: int = Field(0, ge=0, le=MAX_SAMPLING_STEPS)
    #: weight of a separate mean‖v_θ − v_ref‖² to the starting weights (not in the authors' code, whose
    #: anchor is ``target_base: reference``)
    anchor_weight: float = Field(0.0, ge=0, le=MAX_COEFFICIENT)
    core: CoReConfig | None = None
    group_size: int = Field(4, ge=2, le=MAX_GROUP_SIZE)

    @field_validator("latent_reward")
    @classmethod
    def _named(cls, value: str) -> str:
        if not str(value).strip():
            raise ValueError("give the latent reward folder written by flowalign train-reward")
        return value


def reward_folder(path: str) -> Path:
    """A latent reward folder as configs name it: as given, else relative to the repository."""
    p = Path(path)
    if not p.exists() and not p.is_absolute() and (REPO_ROOT / p).exists():
        return REPO_ROOT / p
    return p


def distillation_target(v_base: torch.Tensor, grad: torch.Tensor | Mapping[str, torch.Tensor], kappa: float,
                        weights: Mapping[str, float] | None = None) -> torch.Tensor:
    """``v* = sg(v_b − κ·rms(v_b)·ĝ)`` per sample, ``ĝ`` the authors' ``combine`` of ``grad`` (one gradient:
    ``g/rms(g)``; a dict by head: ``Σ_h w_h·g_h/rms(g_h)``), then their gated and clipped ``correction``;
    ``(B, ...)`` float32 (float64 for float64 inputs). ``x + dt·v*`` is their ``build_rgopd_target`` (dt < 0)."""
    # the same correction as RGS's guided velocity (κ = 0: the base itself)
    return guide_velocity(v_base, grad, kappa, weights=weights).to(torch.promote_types(v_base.dtype, torch.float32)).detach()


def reward_active(sigma: float, kappa: float, active_sigma_min: float) -> bool:
    """Whether the reward corrects the target at ``σ``: the authors' one-band schedule, κ for σ above the
    threshold, else 0 (and then the reward is not evaluated)."""
    return kappa > 0 and sigma > active_sigma_min


def transition_std(noise_level: float, dt: float) -> float:
    """The authors' student transition std (``make_student_policy``): 1 for a deterministic step
    (``noise_level`` 0), else ``max(noise_level·|dt|, 1e-6)``."""
    return 1.0 if noise_level == 0 else max(noise_level * abs(dt), 1e-6)


def rg_opd_loss(v_theta: torch.Tensor, v_star: torch.Tensor, dt: float | None = None, v_ref: torch.Tensor | None = None,
                anchor_weight: float = 0.0, std: float = 1.0) -> torch.Tensor:
    """Scalar. ``dt`` given: ``mean((dt·(v_θ − v*))²)/(2·std²)``, the authors' ``rgopd_loss`` between the Euler
    step's next states ``x + dt·v_θ`` and ``x + dt·v*`` with transition std ``std`` (:func:`transition_std`);
    ``dt`` None: ``mean(v_θ − v*)²``. Plus ``anchor_weight·mean(v_θ − v_ref)²`` when given. Means over every
    element."""
    dtype = torch.promote_types(v_theta.dtype, torch.float32)
    diff = v_theta.to(dtype) - v_star.to(dtype)
    loss = (diff ** 2).mean() if dt is None else ((dt * diff) ** 2).mean() / (2 * max(std * std, 1e-12))
    if v_ref is not None and anchor_weight > 0:
        loss = loss + anchor_weight * ((v_theta.to(dtype) - v_ref.to(dtype)) ** 2).mean()
    return loss


@dataclass(frozen=True)
class DistilUnit:
    """Rollout batch ``chunk`` at visited step ``k`` (step size ``dt = σ_{k+1} − σ_k``) with its fixed target
    ``v*``; one of ``of`` units of an optimiser step."""

    chunk: int
    k: int
    target: torch.Tensor
    of: int
    dt: float


class RGOPDTrainer(GroupTrainer):
    Config = RGOPDConfig
    tcfg: RGOPDConfig
    sampler = "ode"

    @classmethod
    def keeps_velocities(cls, tcfg) -> bool:
        return True  # the rollouts keep v at every step: the distillation's targets

    @classmethod
    def weight_copies(cls, cfg, tcfg) -> list[WeightCopy]:
        """The anchor's ``v_ref`` under full fine-tuning comes from a frozen copy of the starting weights; the
        latent reward holds its own network (refitted by CoRe) and may load its own frozen transformer (read
        from its folder's headers; a folder not there yet declares none, and the run refuses it)."""
        uses_reference = tcfg.anchor_weight > 0 or tcfg.target_base == "reference"
        reference = full_reference(tcfg) if uses_reference and cfg.model.finetune == "full" else []
        folder = reward_folder(tcfg.latent_reward)
        if not (folder / "config.json").is_file():
            return reference
        sizes = latent_reward_sizes(folder)
        reward = [WeightCopy("reward", "model", count=sizes["model"])] if sizes["model"] else []
        own = [WeightCopy("reward", "own", params=sizes["own"])] if sizes["own"] else []
        return reference + reward + own

    def __init__(self, cfg, tcfg: RGOPDConfig, policy, *args: Any, **kwargs: Any):
        if not (reward_folder(tcfg.latent_reward) / "config.json").is_file():
            raise UserError(f"trainer.latent_reward={tcfg.latent_reward}: not a latent reward folder (no config.json); "
                            "write one with `flowalign train-reward --out DIR` first")
        super().__init__(cfg, tcfg, policy, *args, **kwargs)
        folder = reward_folder(tcfg.latent_reward)
        self.latent_reward = load_latent_reward(folder, device=policy.device, dtype=policy.dtype)
        known = list(getattr(self.latent_reward, "head_names", []))
        if tcfg.heads is not None and not set(tcfg.heads) <= set(known):
            raise UserError(f"trainer.heads {tcfg.heads}: the latent reward {tcfg.latent_reward} has heads "
                            f"{', '.join(known) or 'none by name'}")
        if tcfg.head_weights and not set(tcfg.head_weights) <= set(tcfg.heads or []):
            raise UserError(f"trainer.head_weights names {sorted(tcfg.head_weights)}: weigh heads listed in trainer.heads")
        self.real_pairs: PreferencePairs | None = None
        if tcfg.core is not None:
            if self.parallel.world > 1:
                raise UserError("trainer.core refits the registers on one process; run CoRe without multi-process launch")
            if not isinstance(self.latent_reward, torch.nn.Module):
                raise UserError(f"trainer.core needs a trainable latent reward (a torch module); {tcfg.latent_reward} is not")
            path = tcfg.core.real_pairs or str(folder / "pairs.safetensors")
            self.real_pairs = PreferencePairs.load(path)
        #: CoRe's generated pairs, one entry per generator step that gave any: (step, pairs) (trainer state)
        self.core_buffer: list[tuple[int, PreferencePairs]] = []

    # ------------------------------------------------------------------ hooks
    def sampling(self, group: int) -> Sampling:
        """ODE rollouts of θ_old keeping the velocities, so v_old costs no second forward."""
        return Sampling("ode", keep_velocities=True)

    def collect(self, step: int) -> StepBatch:
        """The loop's rollouts and pixel rewards (logged, and CoRe's labels; no advantages), plus the latent
        score of the samples."""
        batch = rewarded_rollouts(self, step)
        with torch.no_grad():
            latent = torch.cat([self.latent_reward.score(c.final_latents, 0.0, c.cond).float().cpu() for c in batch.chunks])
        return dataclasses.replace(batch, logs={**batch.logs, "latent/score": latent.mean().item()})

    def visited_states(self, batch: StepBatch) -> list[tuple[int, int]]:
        """``(chunk, step)`` pairs to distil: the first ``optimized_steps`` (default all but the last) rollout
        steps, or ``steps_per_chunk`` random ones of those per chunk (drawn by a generator keyed by the chunk's
        identity: the same whichever rank holds it)."""
        units = []
        for i, (chunk, key) in enumerate(zip(batch.chunks, batch.chunk_keys())):
            optimized = self.tcfg.optimized_steps or max(chunk.num_steps - 1, 1)
            steps = list(range(min(optimized, chunk.num_steps)))
            if 0 < self.tcfg.steps_per_chunk < len(steps):
                pick = torch.randperm(len(steps), generator=self.keyed_generator(*key, 19))
                steps = sorted(pick[: self.tcfg.steps_per_chunk].tolist())
            units += [(i, k) for k in steps]
        return units

    def reference_velocity(self, chunk: Rollout, k: int) -> torch.Tensor:
        """The starting weights' velocity at visited state ``k`` (no graph)."""
        with torch.no_grad(), self.policy.adapter_disabled():
            return self.policy.velocity(chunk.latents[:, k], chunk.sigmas[k].item(), chunk.cond, chunk.guidance_scale)

    def plan(self, batch: StepBatch, generator: torch.Generator) -> Plan:
        """Targets once (from the frozen reference or θ_old), then the optimiser steps on them: one per
        visited-state index in trajectory order (``per_state``) or one for all (``per_batch``), each unit
        weighted by 1 / its step's units over all ranks (a global plan); ``inner_steps`` passes."""
        pairs = self.visited_states(batch)
        units, stats = [], {"reward_shift": [], "latent_score_visited": [], "target_shift": [], "guided_fraction": []}
        for i, k in pairs:
            chunk = batch.chunks[i]
            x, sigma = chunk.latents[:, k], chunk.sigmas[k].item()
            dt = chunk.sigmas[k + 1].item() - sigma
            base = self.reference_velocity(chunk, k) if self.tcfg.target_base == "reference" else chunk.velocities[:, k]
            guided = reward_active(sigma, self.tcfg.kappa, self.tcfg.active_sigma_min)
            target = base.float().detach()
            if guided:  # outside the active band the reward is not even evaluated (the authors' sparse guidance)
                grad, r = guiding_gradient(self.latent_reward, x, sigma, chunk.cond, self.tcfg.heads,
                                           self.tcfg.head_weights)
                grad = grad.to(base.device) if isinstance(grad, torch.Tensor) else {
                    h: g.to(base.device) for h, g in grad.items()}
                target = distillation_target(base, grad, self.tcfg.kappa, self.tcfg.head_weights)
                stats["latent_score_visited"].append(r.detach().mean())
                stats["reward_shift"].append((per_sample_rms(target - base.float()) / per_sample_rms(base.float()).clamp_min(1e-12)).mean())
            stats["guided_fraction"].append(float(guided))
            stats["target_shift"].append(((target - chunk.velocities[:, k].float()) ** 2).mean())
            units.append((i, k, target, dt))
        if self.tcfg.updates == "per_batch":
            groups = [units]
        else:  # every rank lists every step index, so the collectives below match across ranks
            groups = [[u for u in units if u[1] == j] for j in range(self.tcfg.num_steps)]
        steps = []
        for group in groups:
            total = self.total(len(group))
            if total:  # a step index no rank visits gets no optimiser step
                steps.append([DistilUnit(i, k, target, total, dt) for i, k, target, dt in group])
        return Plan(steps * self.tcfg.inner_steps, unit_logs.merged({k: v for k, v in stats.items() if v}),
                    global_weights=True)

    def loss(self, batch: StepBatch, unit: DistilUnit) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        loss = self.loss_at(batch.chunks[unit.chunk], unit.k, unit.target, unit.dt)
        return loss / unit.of, {"distill_loss": loss.detach()}

    def loss_at(self, chunk: Rollout, k: int, target: torch.Tensor, dt: float | None = None) -> torch.Tensor:
        x, sigma = chunk.latents[:, k], chunk.sigmas[k].item()
        if dt is None:
            dt = chunk.sigmas[k + 1].item() - sigma
        v = self.policy.velocity(x, sigma, chunk.cond, chunk.guidance_scale)
        v_ref = self.reference_velocity(chunk, k) if self.tcfg.anchor_weight > 0 else None
        return rg_opd_loss(v, target.to(v.device), dt if self.tcfg.loss_space == "transition" else None, v_ref,
                           self.tcfg.anchor_weight, transition_std(self.tcfg.transition_noise, dt))

    def finish(self, batch: StepBatch, steps: list[dict[str, list[float]]]) -> dict[str, float]:
        """With CoRe: remember this step's generated pairs; refit the registers when due (and write the
        co-evolved reward as a reward folder, ``latent_reward/``)."""
        if self.tcfg.core is None:
            return {}
        self.remember_generated_pairs(batch)
        if (self.step + 1) % self.tcfg.core.every:
            return {}
        out = {f"core_{k}": v for k, v in self.refit_reward().items()}
        if self.acc.is_main_process and hasattr(self.latent_reward, "save"):
            self.latent_reward.save(self.run_dir / "latent_reward")
        return out

    def state_dict(self) -> dict[str, Any]:
        """With CoRe: the refit reward's tensors and the buffered generated pairs."""
        if self.tcfg.core is None:
            return {}
        state: dict[str, Any] = {f"latent_reward.{k}": v for k, v in self.latent_reward.state_dict().items()}
        for step, pairs in self.core_buffer:
            state.update({f"core.{step}.chosen": pairs.chosen, f"core.{step}.rejected": pairs.rejected,
                          f"core.{step}.margin": pairs.margin})
        state["core_prompts"] = {str(step): pairs.prompts for step, pairs in self.core_buffer}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.tcfg.core is None:
            return
        prefix = "latent_reward."
        self.latent_reward.load_state_dict({k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)})
        self.core_buffer = [
            (int(step), PreferencePairs(prompts, state[f"core.{step}.chosen"], state[f"core.{step}.rejected"],
                                        state[f"core.{step}.margin"]))
            for step, prompts in sorted(state.get("core_prompts", {}).items(), key=lambda kv: int(kv[0]))
        ]

    # ------------------------------------------------------------------ CoRe
    def generated_pairs(self, batch: StepBatch) -> PreferencePairs | None:
        """Within each prompt group, every pair of samples whose pixel rewards differ (chosen = higher)."""
        x0 = torch.cat([c.final_latents.float().cpu() for c in batch.chunks])
        valid = batch.scores.valid
        scores = torch.where(valid, batch.scores.total, torch.full((len(valid),), float("nan")))
        prompts, groups = batch.prompts, batch.groups
        chosen, rejected, names, margins = [], [], [], []
        for g in torch.unique(groups).tolist():
            idx = (groups == g).nonzero().flatten().tolist()
            for a in idx:
                for b in idx:
                    d = float(scores[a] - scores[b])
                    if np.isfinite(d) and d > self.tcfg.core.min_margin:
                        chosen.append(x0[a])
                        rejected.append(x0[b])
                        names.append(prompts[a])
                        margins.append(d)
        if not names:
            return None
        return PreferencePairs(names, torch.stack(chosen), torch.stack(rejected), torch.tensor(margins))

    def remember_generated_pairs(self, batch: StepBatch) -> None:
        """Add this step's generated pairs to the buffer; forget those older than ``core.buffer_steps``."""
        pairs = self.generated_pairs(batch)
        if pairs is not None:
            self.core_buffer.append((self.step, pairs))
        keep = self.tcfg.core.buffer_steps or self.tcfg.core.every
        self.core_buffer = [(s, p) for s, p in self.core_buffer if s > self.step - keep]

    def refit_reward(self) -> dict[str, float]:
        """CoRe: ``core.steps`` minibatches of L_RM on the real pairs and the buffered generated pairs."""
        core = self.tcfg.core
        generated = PreferencePairs.cat([p for _, p in self.core_buffer]) if self.core_buffer else None
        self.latent_reward.train()
        stats = fit(self.latent_reward, self.real_pairs, self.policy.encode, steps=core.steps, batch_size=core.batch_size,
                    lr=core.lr, seed=derived_seed(self.cfg.run.seed, self.step, 7), generated=generated, mu=core.mu,
                    anchor=core.anchor_weight)
        self.latent_reward.eval()
        stats["generated_pairs"] = float(len(generated) if generated is not None else 0)
        return stats
