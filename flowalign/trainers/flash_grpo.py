"""Flash-GRPO (arXiv 2605.15980): iso-temporal single-step GRPO with temporal gradient rectification.

Read against ``docs/methods/flow_grpo.md``. Per unique prompt one step ``k_c ~ U{0 … T/2−1}`` is drawn
once and shared by the whole group; each member runs the ODE from its own noise except ONE SDE step at
``k_c`` (noise ``s_k = σ_1·σ_k`` in the Flow-GRPO mean, as the authors coded it), and only that step is
trained. Because ``∂ℓ/∂v = −ξ·c_k`` with ``c_k = |γ_k|/τ_k`` for a Gaussian step ``μ = αx + γv``, steps
far apart in σ get very different gradient scales; each sample's loss is weighted by
``ω_i = (1/c_{k_i}) / mean_all(1/c_k)`` so the per-timestep gradient norms are flat across k. The loss
is Flow-GRPO's with these weights; the hooks here choose the sampling and the weights.
"""

from __future__ import annotations

import math
import dataclasses
from dataclasses import dataclass
from typing import Literal

import torch
from pydantic import Field, model_validator

from flowalign.limits import MAX_COEFFICIENT, MAX_SAMPLING_STEPS
from flowalign.sampling import Rollout, StepOutput, flow_sde_step
from flowalign.trainers.base import Plan, Sampling, StepBatch, derived_seed
from flowalign.trainers.flow_grpo import FlowGRPOBase, FlowGRPOTrainer
from flowalign.trainers.options import ReferenceOptions
from flowalign.trainers.parts.global_plan import ChunkRef


class FlashGRPOConfig(FlowGRPOBase, ReferenceOptions):
    name: Literal["flash_grpo"] = "flash_grpo"  # type: ignore[assignment]
    #: what runs saved before these options existed computed (see TrainerConfig.before)
    before = {"rectify_mean": "batch"}
    num_steps: int = Field(20, ge=4, le=MAX_SAMPLING_STEPS)
    clip_range: float = Field(1e-3, gt=0, le=MAX_COEFFICIENT)
    beta: float = Field(0.0, ge=0, le=MAX_COEFFICIENT)
    #: iso-temporal steps are drawn from {0 … ⌊T·max_step_fraction⌋ − 1}
    max_step_fraction: float = Field(0.5, gt=0, le=1)
    rectify: bool = True
    #: where 1/c_k comes from: the model's σ grid ("grid"), or the authors' hard-coded table for steps 0-9 of
    #: Wan 2.1's 20-step 480p grid ("wan_table", within 0.25 % of that grid's values)
    rectify_source: Literal["grid", "wan_table"] = "grid"
    #: over which samples the mean ω is 1: each optimiser step's samples with an advantage, over every rank
    #: ("step": the authors', who normalise each micro-batch, one optimiser step in their recipe), or the whole
    #: batch of the training step ("batch", the former form)
    rectify_mean: Literal["step", "batch"] = "step"

    @model_validator(mode="after")
    def _table_covers_the_steps(self) -> FlashGRPOConfig:
        if self.rectify_source == "wan_table" and (self.num_steps != 20
                                                   or int(self.num_steps * self.max_step_fraction) > len(WAN_TABLE)):
            raise ValueError("trainer.rectify_source=wan_table holds steps 0-9 of a 20-step grid: set "
                             "trainer.num_steps=20 and max_step_fraction <= 0.5, or rectify_source=grid")
        return self


#: the authors' ``value_dict`` (scripts/train_wanx2_1_flash.py, Shredded-Pork/Flash-GRPO at 4211013): 1/c_k
#: for steps 0-9 of Wan 2.1's 20-step 480p grid, here by step index (their keys are their diffusers version's
#: timesteps 999, 982, 963, …; today's UniPC grid gives 999, 982, 964, …)
WAN_TABLE = (7.4770, 7.0414, 6.6112, 6.1867, 5.7682, 5.3559, 4.9502, 4.5513, 4.1596, 3.7754)


def flash_diffusion(sigmas: torch.Tensor, k: int) -> float:
    """The authors' SDE noise ``s_k = σ_1·σ_k`` on the scheduler grid ``sigmas`` ``(T+1,)``."""
    return float(sigmas[1] * sigmas[k])


def rectification_coefficient(sigmas: torch.Tensor, k: int) -> float:
    """``c_k = |γ_k| / τ_k`` of the Flow-GRPO-form step at ``k`` [derived]:
    ``γ = (1 + s²(1−σ)/(2σ))·Δ``, ``τ = s·sqrt(h)``, i.e. ``sqrt(h)/s + s·sqrt(h)(1−σ)/(2σ)``."""
    sigma, sigma_next = float(sigmas[k]), float(sigmas[k + 1])
    h = sigma - sigma_next
    s = flash_diffusion(sigmas, k)
    gamma = (1 + s**2 * (1 - sigma) / (2 * sigma)) * h
    return abs(gamma) / (s * math.sqrt(h))


def inverse_rectification(sigmas: torch.Tensor, k: int, source: Literal["grid", "wan_table"] = "grid") -> float:
    """``1/c_k`` of step ``k``: from the grid ``sigmas`` ``(T+1,)`` (the authors' ``coe``) or their table."""
    return WAN_TABLE[k] if source == "wan_table" else 1.0 / rectification_coefficient(sigmas, k)


@dataclass(frozen=True)
class FlashStep:
    """The Flow-GRPO-form SDE step with a fixed noise ``s`` (a value, so equal steps batch together)."""

    diffusion: float

    def __call__(self, v, x, sigma, sigma_next, generator, prev_sample) -> StepOutput:
        return flow_sde_step(v, x, sigma, sigma_next, diffusion=self.diffusion, generator=generator,
                             prev_sample=prev_sample)


class FlashGRPOTrainer(FlowGRPOTrainer):
    Config = FlashGRPOConfig
    tcfg: FlashGRPOConfig

    @classmethod
    def reference_steps(cls, tcfg: FlashGRPOConfig) -> int:
        """The group's one SDE step ``k_c``, the same in every inner epoch."""
        return 1

    @property
    def sampler(self) -> str:  # type: ignore[override]
        """Its step has the Flow-GRPO form (its own noise ``s_k``): the KL's coded gap is the step's σ gap."""
        return "flow_grpo"

    def trained_steps(self, chunk: Rollout) -> list[int]:
        """The group's one SDE step ``k_c``."""
        return chunk.trained_steps()

    def chosen_steps(self, chunk: ChunkRef, epoch: int) -> list[int]:
        """``k_c``, in every inner epoch."""
        return list(chunk.steps)

    def iso_temporal_step(self, group_id: int) -> int:
        """``k_c`` of a prompt group, seeded by (run seed, step, group id): every rank computes the same
        value, so no broadcast is needed."""
        g = torch.Generator().manual_seed(derived_seed(self.cfg.run.seed, self.step, group_id, 7))
        high = max(1, int(self.tcfg.num_steps * self.tcfg.max_step_fraction))
        return int(torch.randint(0, high, (1,), generator=g))

    def sampling(self, group: int) -> Sampling:
        """The whole group shares ``k_c``: ODE everywhere except one SDE step there."""
        k = self.iso_temporal_step(group)
        sigmas = self.policy.sigmas(self.tcfg.num_steps).float().cpu()
        return Sampling(FlashStep(flash_diffusion(sigmas, k)), sde_window=(k, 1),
                        keep_unconditional=self.reuses_unconditional)

    def inverse_rectifications(self, batch: StepBatch) -> torch.Tensor:
        """``1/c_{k_i}`` of every sample of this rank's batch ``(N,)`` (a chunk's samples share its step)."""
        source = self.tcfg.rectify_source
        return torch.cat([torch.full((len(c),), inverse_rectification(c.sigmas, c.trained_steps()[0], source))
                          for c in batch.chunks])

    def sample_weights(self, batch: StepBatch) -> torch.Tensor | None:
        """With ``rectify_mean: batch``, ``ω_i = (1/c_{k_i}) / mean over all ranks' samples of 1/c_k`` ``(N,)``
        (mean ω = 1 over the batch); None (every sample weighs 1) without ``rectify``, or where :meth:`plan`
        normalises ω per optimiser step."""
        if not self.tcfg.rectify or self.tcfg.rectify_mean == "step":
            return None
        inv_c = self.inverse_rectifications(batch)
        return inv_c / self.gather(inv_c).float().mean()

    def plan(self, batch: StepBatch, generator: torch.Generator) -> Plan:
        """Flow-GRPO's plan; with ``rectify_mean: step`` each unit weighted by ``ω_i = (1/c_{k_i}) / mean of
        1/c_k`` over its optimiser step's samples with a non-zero advantage on every rank (mean ω = 1 within
        each optimiser step, as the authors' ``1/accelerator.reduce(value_tensor.mean())`` per micro-batch)."""
        plan = super().plan(batch, generator)
        if not self.tcfg.rectify or self.tcfg.rectify_mean == "batch":
            return plan
        inv_c, advantages = batch.per_chunk(self.inverse_rectifications(batch)), batch.per_chunk(batch.advantages)
        mine = []  # each optimiser step's sum of 1/c_k over this rank's samples with an advantage, and their count
        for units in plan.steps:
            counted = [advantages[u.chunk] != 0 for u in units]
            mine.append((sum(float(inv_c[u.chunk][c].sum()) for u, c in zip(units, counted)),
                         sum(int(c.sum()) for c in counted)))
        parts = self.gather_objects(mine)
        totals = [(sum(p[n][0] for p in parts), sum(p[n][1] for p in parts)) for n in range(len(mine))]
        steps = [[dataclasses.replace(u, weight=inv_c[u.chunk] * (count / total)) for u in units]
                 for units, (total, count) in zip(plan.steps, totals)]
        return dataclasses.replace(plan, steps=steps)

    def step_distribution(self, chunk, k, velocity) -> StepOutput:
        x_k, x_next, _ = chunk.step(k)
        step = FlashStep(flash_diffusion(chunk.sigmas, k))
        return step(velocity, x_k, chunk.sigmas[k].item(), chunk.sigmas[k + 1].item(), None, x_next)
