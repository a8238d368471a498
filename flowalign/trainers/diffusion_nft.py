"""DiffusionNFT (arXiv 2509.16117): the baseline DiffusionOPSD is measured against
(``docs/methods/diffusion_nft.md``).

Same behaviour policy φ, ODE rollouts, mirrored velocities ``v±``, reward weight ``r`` and soft refresh
as OPSD (all from ``self_distill.py``); what differs is the training signal: each rollout endpoint ``x_0``
is forward-noised, ``x_t = (1−t)·x_0 + t·ε``, at ``⌊timestep_fraction·T⌋`` of the sampler's T timesteps
(a fresh permutation per sample), and, as the authors' ``train_nft_sd3.py`` computes it,

    x̂0± = x_t − t·v±,   w± = mean|x̂0± − x_0|  (no gradient),
    L = (A_max/β)·[ r·mean((x̂0⁺ − x_0)²/w⁺) + (1−r)·mean((x̂0⁻ − x_0)²/w⁻) ] + β_KL·mean((v_θ − v_ref)²)

so no reward gradient is needed: any reward (the verifier itself) works. ``loss_form: velocity`` keeps the
plain flow-matching form ``r·mean(v⁺ − v)² + (1−r)·mean(v⁻ − v)²``, ``v = ε − x_0``.

With ``fit_steps: K`` the step's samples are shuffled and dealt into K disjoint parts, one optimiser step on
each (the authors' ``gradient_step_per_epoch``; ``fit_split: whole_batch`` steps K times over every sample),
and the behaviour refresh may start flat (``behaviour_flat``, the authors' ``decay_type 2``).
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field, model_validator

from flowalign.limits import MAX_COEFFICIENT, MAX_GUIDANCE, MAX_TRAIN_STEPS
from flowalign.sampling import Rollout
from flowalign.trainers.base import StepBatch
from flowalign.trainers.copies import WeightCopy, full_reference
from flowalign.trainers.options import ReferenceOptions
from flowalign.trainers.parts.sample_parts import sample_keys, sample_parts
from flowalign.trainers.parts.negative_aware import NFTLossForm as LossForm
from flowalign.trainers.parts.negative_aware import nft_loss
from flowalign.trainers.self_distill import FitUnit, SelfDistillConfig, SelfDistillTrainer, behaviour_lambda

FitSplit = Literal["shuffled_parts", "whole_batch"]


class DiffusionNFTConfig(SelfDistillConfig, ReferenceOptions):
    name: Literal["diffusion_nft"] = "diffusion_nft"
    #: what runs saved before these options existed computed (see TrainerConfig.before)
    before = {"fit_split": "whole_batch", "loss_form": "velocity"}
    #: trained timesteps per sample: ⌊fraction·T⌋ of the T sampler timesteps, a fresh random permutation per
    #: sample and update (the authors' ``train.timestep_fraction`` 0.99: 9 of 10)
    timestep_fraction: float = Field(0.99, gt=0, le=1)
    #: weight of the KL term ``mean (v_θ − v_ref)²`` to the starting weights (the authors' ``train.beta`` 1e-4)
    beta: float = Field(1e-4, ge=0, le=MAX_COEFFICIENT)
    #: ``x0_normalised``: the authors' loss (module docstring); ``velocity``: plain mean squared velocity error,
    #: without the A_max/β scale
    loss_form: LossForm = "x0_normalised"
    #: 1.0 here: the conditional velocity is the quantity whose flow-matching target ``ε − x_0`` is (the
    #: authors sample and train with ``guidance_scale 1.0``); None fits the guided velocity
    fit_guidance: float | None = Field(1.0, ge=1.0, le=MAX_GUIDANCE)
    #: how the ``fit_steps`` optimiser steps share the step's samples. ``shuffled_parts``: shuffled and dealt
    #: into ``fit_steps`` disjoint parts of equal size, one step on each (the authors' ``gradient_step_per_epoch``);
    #: ``whole_batch``: every step on every sample
    fit_split: FitSplit = "shuffled_parts"
    #: λ = 0 (φ copies θ) for the first ``behaviour_flat`` optimiser steps, then
    #: ``min(behaviour_rate·(s − behaviour_flat), behaviour_max)`` (the authors' ``decay_type 2``: 75)
    behaviour_flat: int = Field(0, ge=0, le=MAX_TRAIN_STEPS)

    @model_validator(mode="after")
    def _parts_hold_samples(self):
        samples = self.prompts_per_step * self.group_size
        if self.fit_split == "shuffled_parts" and self.fit_steps > samples:
            raise ValueError(f"trainer.fit_steps={self.fit_steps} parts cannot each hold one of the "
                             f"{samples} samples a step draws (prompts_per_step × group_size); lower fit_steps "
                             "or use trainer.fit_split=whole_batch")
        return self

    @model_validator(mode="before")
    @classmethod
    def _former_timestep_count(cls, data):
        if isinstance(data, dict) and "timesteps_per_sample" in data:
            raise ValueError("trainer.timesteps_per_sample is now trainer.timestep_fraction (the fraction of the "
                             "sampler's timesteps trained per sample, e.g. 0.99)")
        return data


def drawn_timesteps(num_samples: int, num_timesteps: int, fraction: float,
                    generator: torch.Generator) -> torch.Tensor:
    """``(⌊fraction·T⌋, B)`` indices into the T sampler timesteps: row j holds each sample's j-th trained
    timestep, the first ⌊fraction·T⌋ entries of a fresh permutation per sample (the authors' ``perms_time``)."""
    n = max(1, int(num_timesteps * fraction))
    perms = torch.stack([torch.randperm(num_timesteps, generator=generator) for _ in range(num_samples)])
    return perms[:, :n].T


def forward_draws(shape: torch.Size, num_timesteps: int, fraction: float,
                  generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """What forward-noising a rollout batch of ``shape`` ``(B, ...)`` draws: the timesteps ``(n, B)`` of
    :func:`drawn_timesteps` and then one noise ``ε`` ``(n, B, ...)`` per row of them."""
    picked = drawn_timesteps(shape[0], num_timesteps, fraction, generator)
    return picked, torch.stack([torch.randn(shape, generator=generator) for _ in range(len(picked))])


def unit_samples(unit: FitUnit, index: torch.Tensor) -> FitUnit:
    """``unit`` restricted to samples ``index`` ``(b,)`` of its chunk (every tensor of an NFT unit is per sample)."""
    return FitUnit(unit.chunk.select(index), unit.r[index.to(unit.r.device)], unit.keep[index],
                   {k: v[index.to(v.device)] for k, v in unit.tensors.items()})


class DiffusionNFTTrainer(SelfDistillTrainer):
    Config = DiffusionNFTConfig
    tcfg: DiffusionNFTConfig

    @classmethod
    def weight_copies(cls, cfg, tcfg) -> list[WeightCopy]:
        """The behaviour weights, and the KL term's ``v_ref`` under full fine-tuning from a frozen copy of the
        starting weights."""
        reference = full_reference(tcfg) if tcfg.beta > 0 and cfg.model.finetune == "full" else []
        return super().weight_copies(cfg, tcfg) + reference

    def fit_units(self, chunk: Rollout, r: torch.Tensor, keep: torch.Tensor, generator: torch.Generator) -> list[FitUnit]:
        """One unit per trained timestep index: each sample noised at its own drawn timestep, and ``v_φ``
        there (the caller swapped φ in), with the reference's ``v_ref`` when the KL term is on."""
        x0 = chunk.final_latents.to(self.policy.device)
        sigmas = chunk.sigmas[:-1]  # the sampler's T timesteps; σ = 0 is the clean sample
        guidance = self.fit_guidance(chunk)
        units = []
        for picked, eps in zip(*forward_draws(x0.shape, len(sigmas), self.tcfg.timestep_fraction, generator)):
            t = sigmas[picked].to(x0, non_blocking=True)
            eps = eps.to(x0, non_blocking=True)
            t_b = t.view(-1, *([1] * (x0.ndim - 1)))
            x_t = (1 - t_b) * x0 + t_b * eps
            with torch.no_grad():
                v_phi = self.policy.velocity(x_t, t, chunk.cond, guidance)
                tensors = {"t": t, "x_t": x_t, "x0": x0, "eps": eps, "v_phi": v_phi}
                if self.tcfg.beta > 0:  # the KL's target is fixed: once here, not once per fit step
                    with self.policy.adapter_disabled():
                        tensors["v_ref"] = self.policy.velocity(x_t, t, chunk.cond, guidance)
            units.append(FitUnit(chunk, r.to(x0.device, non_blocking=True), keep, tensors))
        return units

    def fit_loss(self, unit: FitUnit) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        x = unit.tensors
        v_theta = self.policy.velocity(x["x_t"], x["t"], unit.chunk.cond, self.fit_guidance(unit.chunk))
        return nft_loss(v_theta, x["v_phi"], x["x_t"], x["x0"], x["eps"], x["t"], unit.r, self.tcfg.mirror_beta,
                        self.tcfg.adv_clip, self.tcfg.loss_form, x.get("v_ref"), self.tcfg.beta)

    def fit_schedule(self, batch: StepBatch, units: list[list[FitUnit]],
                     generator: torch.Generator) -> list[list[FitUnit]]:
        """``shuffled_parts``: step k takes every unit restricted to the samples of part k
        (:func:`~flowalign.trainers.parts.sample_parts.sample_parts`, over every rank's samples)."""
        if self.tcfg.fit_split == "whole_batch" or self.tcfg.fit_steps == 1:
            return super().fit_schedule(batch, units, generator)
        keys = sample_keys(batch.groups)
        part = sample_parts(keys, self.gather(keys), self.tcfg.fit_steps, generator)
        steps: list[list[FitUnit]] = [[] for _ in range(self.tcfg.fit_steps)]
        for chunk_units, chunk_part in zip(units, batch.per_chunk(part)):
            for k, step in enumerate(steps):
                index = (chunk_part == k).nonzero().flatten()
                if len(index):
                    step.extend(unit_samples(u, index) for u in chunk_units)
        return steps

    def refresh_lambda(self, step: int) -> float:
        """``0`` for ``s < behaviour_flat``, then ``min(behaviour_rate·(s − behaviour_flat), behaviour_max)``."""
        return behaviour_lambda(step, self.tcfg.behaviour_rate, self.tcfg.behaviour_max, self.tcfg.behaviour_flat)

    def filler(self, batch: StepBatch, update: int) -> FitUnit:
        """One sample of the first rollout at its first timestep, zero targets: the forward a sharded rank with
        no sample in this step's part runs (weighted 0 by the loop)."""
        chunk = batch.chunks[0].select([0])
        x0 = chunk.final_latents.to(self.policy.device)
        zeros = torch.zeros_like(x0)
        tensors = {"t": chunk.sigmas[:1].to(x0), "x_t": x0, "x0": x0, "eps": zeros, "v_phi": zeros}
        if self.tcfg.beta > 0:
            tensors["v_ref"] = zeros
        return FitUnit(chunk, torch.full((1,), 0.5).to(x0), torch.ones(1, dtype=torch.bool), tensors)
