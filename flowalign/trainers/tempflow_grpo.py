"""TempFlow-GRPO (arXiv 2508.04324): Flow-GRPO with trajectory branching and noise-aware weighting
(``docs/methods/tempflow_grpo.md``).

The sampler changes, not the loss's form (:mod:`flowalign.sampling.branching`). Every member of a prompt
group starts from the group's ``x_T`` and follows the ODE except at one branching step ``k``, where it takes
the Flow-GRPO SDE step. ``branching: every_step`` (the authors' script) branches each prompt group's
trajectory at every candidate step, ``group_size`` branches per step, advantages normalised per (prompt,
step), and trains every (branch, step); ``branching: one_step`` draws one ``k`` per group and training step.
The loss is Flow-GRPO's clipped surrogate with the step's noise-aware weight ``w_k`` (``τ_k / mean_{j∈K} τ_j``,
or ``c·τ_k`` with ``noise_weight_scale: c``) and the authors' KL scaled by the step's own variance:

    r = exp(ℓ_k(θ) − ℓ_k(θ_old))
    L = mean_i w_k·max(−A_i·r, −A_i·clip(r, 1−ε, 1+ε)) + β·mean_D (μ_θ − μ_ref)² / (2τ_k²)
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import torch
from pydantic import Field

from flowalign.config import StepIndex
from flowalign.errors import UserError
from flowalign.limits import MAX_COEFFICIENT
from flowalign.sampling import Rollout, StepOutput, branch_candidates, draw_branch_step, noise_aware_weights, rollout
from flowalign.trainers.base import Sampling, StepBatch
from flowalign.trainers.flow_grpo import FlowGRPOBase, FlowGRPOTrainer, SDEOptions, StepUnit
from flowalign.trainers.options import ReferenceOptions
from flowalign.trainers.parts.global_plan import ChunkRef
from flowalign.trainers.parts.policy_gradient import ppo_clip_loss


class TempFlowGRPOConfig(FlowGRPOBase, ReferenceOptions, SDEOptions):
    name: Literal["tempflow_grpo"] = "tempflow_grpo"
    #: what runs saved before these options existed computed (see TrainerConfig.before)
    before = {"branching": "one_step", "ode_prefix": "recomputed"}
    #: the noise-aware weight needs a Gaussian step of known std
    sampler: Literal["flow_grpo", "dance"] = "flow_grpo"  # type: ignore[assignment]
    #: "every_step" (the authors'): each prompt group's trajectory branches at every step of branch_steps,
    #: group_size SDE branches per step each finished by the ODE, advantages per (prompt, step), every
    #: (branch, step) trained; "one_step": one step drawn per group and training step, group_size branches there
    branching: Literal["every_step", "one_step"] = "every_step"
    #: the steps a group branches at (every_step: all of them; one_step: one drawn per group and training
    #: step); None: 0 … num_steps − 2
    branch_steps: list[StepIndex] | None = None
    #: each trained step's surrogate weighted by w_k (see noise_weight_scale)
    noise_weighting: bool = True
    #: None: w_k = τ_k / mean over branch_steps of τ (mean 1 on any grid); a number c: w_k = c·τ_k (the
    #: authors' SD3.5 script: 2.25, within 0.1 % of the normalised weights on SD3.5's 10-step grid)
    noise_weight_scale: float | None = Field(None, gt=0, le=MAX_COEFFICIENT)
    #: a seed group: every member of a prompt group starts from the same x_T (every_step needs it)
    shared_initial_noise: bool = True
    #: "shared" (the authors'): the ODE path from a group's x_T is integrated once and every branch leaves it at
    #: its branching step; "recomputed": each branch integrates the path x_T → x_k itself (the same states up
    #: to kernel rounding, k more transformer passes a branch). Without shared_initial_noise nothing is shared
    ode_prefix: Literal["shared", "recomputed"] = "shared"
    advantage: str = Field("group", pattern="^(group|global_std|per_reward|gdpo|win_rate)$")
    #: weight β of the KL to the reference, the authors' pickscore_sd3_pr value; with kl_mode code it is their
    #: mean_D (μ − μ_ref)² / (2τ_k²), the step's own variance
    beta: float = Field(0.001, ge=0, le=MAX_COEFFICIENT)


def weighted_clip_loss(log_prob: torch.Tensor, old_log_prob: torch.Tensor, adv: torch.Tensor, clip_range: float,
                       step_weight: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample ``w_k·max(−A·r, −A·clip(r, 1−ε, 1+ε))`` ``(B,)`` with ``r = exp(ℓ − ℓ_old)``, the ratio
    and the clipped flag (``step_weight`` = ``w_k``, or 1)."""
    per_sample, ratio, clipped = ppo_clip_loss(log_prob, old_log_prob, adv, clip_range)
    return step_weight * per_sample, ratio, clipped


def step_variance_kl(coded_kl: torch.Tensor, sigma: float, sigma_next: float) -> torch.Tensor:
    """The authors' TempFlow KL ``mean_D (μ − μ_ref)² / (2τ_k²)`` from Flow-GRPO's coded one
    ``mean_D (μ − μ_ref)² / (2τ_k²/h)`` (``h = σ_k − σ_{k+1}``): their SDE step returns the noise std ``τ_k``
    itself, flow_grpo's the diffusion coefficient ``τ_k/sqrt(h)``."""
    return coded_kl / (sigma - sigma_next)


def branch_groups(trajectories: torch.Tensor, step_index: torch.Tensor, num_candidates: int) -> torch.Tensor:
    """Ids ``(N,)`` of the (trajectory or prompt, branching step) groups: ``id·|K| + index of k in K``, so the
    advantages of every_step are normalised per (prompt, step) and the branches of one step form a group."""
    return trajectories * num_candidates + step_index


class TempFlowGRPOTrainer(FlowGRPOTrainer):
    Config = TempFlowGRPOConfig
    tcfg: TempFlowGRPOConfig

    @classmethod
    def check_config(cls, cfg, tcfg) -> None:
        super().check_config(cfg, tcfg)
        if tcfg.branching == "every_step" and not tcfg.shared_initial_noise:
            raise UserError("trainer.shared_initial_noise: branching: every_step branches one trajectory per prompt "
                            "group, so its members share x_T; set it true (or trainer.branching=one_step)")
        try:
            branch_candidates(tcfg.num_steps, tcfg.branch_steps)
        except ValueError as e:
            raise UserError(f"trainer.branch_steps: {e}, e.g. [0, 1, 2, 3]") from None

    @classmethod
    def rollouts_per_step(cls, tcfg: TempFlowGRPOConfig) -> tuple[int, int, int]:
        """every_step: each prompt group rolls out ``group_size`` branches at each of its ``|K|`` branching steps,
        ``|K|·group_size`` samples a prompt (:meth:`collect`); one_step: the loop's ``group_size``."""
        prompts, group, steps = super().rollouts_per_step(tcfg)
        if tcfg.branching == "every_step":
            group *= len(branch_candidates(tcfg.num_steps, tcfg.branch_steps))
        return prompts, group, steps

    @classmethod
    def reference_steps(cls, tcfg: TempFlowGRPOConfig) -> int:
        """A rollout's one branching step, the same in every inner epoch."""
        return 1

    @property
    def candidates(self) -> list[int]:
        return branch_candidates(self.tcfg.num_steps, self.tcfg.branch_steps)

    def branch_step(self, group: int) -> int:
        """The branching step of rollout group ``group`` this training step. every_step: a group is one
        (prompt group, step) pair, its step ``K[group mod |K|]``; one_step: drawn, keyed by (seed, step, group),
        so every rank and a resumed run draw alike."""
        if self.tcfg.branching == "every_step":
            return self.candidates[group % len(self.candidates)]
        return draw_branch_step(self.candidates, self.keyed_generator(group, 23))

    def sampling(self, group: int) -> Sampling:
        """ODE everywhere but the group's branching step, an SDE step there."""
        return Sampling(self.sampler, self.noise_level, (self.branch_step(group), 1), False,
                        keep_unconditional=self.reuses_unconditional)

    def collect(self, step: int) -> StepBatch:
        if self.tcfg.branching == "one_step":
            batch = super().collect(step)
            ks = [c.trained_steps()[0] for c in batch.chunks]
            batch.logs["branch_step"] = float(sum(ks) / len(ks))
            return batch
        # every_step: prompt group g (global id) rolls out group_size branches at each candidate step; rollout
        # group g·|K| + i holds those of step K[i], its advantages normalised per (prompt, K[i])
        p, n, g_size = self.tcfg.prompts_per_step, len(self.candidates), self.tcfg.group_size
        idx = self.step_indices(step)
        trajectories = torch.arange(self.rank * p, (self.rank + 1) * p).repeat_interleave(n * g_size)
        prompt_ids = torch.tensor(idx).repeat_interleave(n * g_size)
        steps = torch.arange(n).repeat_interleave(g_size).repeat(p)
        prompts = [self.data.prompts[i] for i in idx for _ in range(n * g_size)]
        metadata = [self.data.metadata[i] for i in idx for _ in range(n * g_size)]
        return self.group_batch(prompts, metadata, branch_groups(trajectories, steps, n),
                                branch_groups(prompt_ids, steps, n), step)

    def rollout_slots(self, prompts: list[str], metadata: list[dict], groups: torch.Tensor,
                      prompt_ids: torch.Tensor, step: int) -> list:
        """every_step: all branches of prompt group g (every step's) start from its one ``x_T`` and draw their
        SDE noise from generators keyed by (seed, step, g, branch): the trajectory is the authors' one ODE path
        per prompt group, whatever the batching or rank layout. With ``ode_prefix: shared`` that path is
        integrated once per trajectory (:meth:`ode_paths`) and each branch starts from its state at the branching
        step."""
        if self.tcfg.branching == "one_step":
            slots = super().rollout_slots(prompts, metadata, groups, prompt_ids, step)
            trajectories = groups.tolist()
        else:
            # the loop's slots of the prompt groups, x_T shared (check_config makes every_step share it)
            trajectories = (groups // len(self.candidates)).tolist()
            slots = super().rollout_slots(prompts, metadata, groups // len(self.candidates), prompt_ids, step)
            slots = [dataclasses.replace(s, group=g) for s, g in zip(slots, groups.tolist())]
        if self.tcfg.ode_prefix == "recomputed" or not self.tcfg.shared_initial_noise:
            return slots
        paths = self.ode_paths({t: s for t, s in zip(trajectories, slots)})
        return [dataclasses.replace(s, prefix=paths[t][: self.branch_step(s.group) + 1])
                for t, s in zip(trajectories, slots)]

    def ode_paths(self, firsts: dict[int, Any]) -> dict[int, torch.Tensor]:
        """Each trajectory's ODE states ``(T + 1, ...)`` from its shared ``x_T``, ``firsts`` holding one slot of it
        (its prompt, metadata and ``x_T``), integrated in batches of ``batch_size`` as the branches' own ODE
        steps integrate (the rollout's Euler step, its guidance)."""
        keys = list(firsts)
        paths: dict[int, torch.Tensor] = {}
        for i in range(0, len(keys), self.tcfg.batch_size):
            chunk = [firsts[k] for k in keys[i : i + self.tcfg.batch_size]]
            trunk = rollout(self.policy, [s.prompt for s in chunk], num_steps=self.tcfg.num_steps, sampler="ode",
                            guidance_scale=self.tcfg.guidance_scale, metadata=[s.metadata for s in chunk],
                            initial_noise=torch.cat([s.initial_noise for s in chunk]), decode=False)
            paths.update(zip(keys[i : i + self.tcfg.batch_size], trunk.latents.unbind(0)))
        return paths

    def trained_steps(self, chunk: Rollout) -> list[int]:
        """The branching step."""
        return chunk.trained_steps()

    def chosen_steps(self, chunk: ChunkRef, epoch: int) -> list[int]:
        """The branching step, in every inner epoch."""
        return list(chunk.steps)

    def step_weight(self, chunk: Rollout, k: int) -> float:
        """``w_k`` of :func:`~flowalign.sampling.branching.noise_aware_weights` (1 without noise_weighting)."""
        if not self.tcfg.noise_weighting:
            return 1.0
        return noise_aware_weights(chunk.sigmas, self.candidates, self.sampler, self.noise_level,
                                   self.tcfg.noise_weight_scale)[k]

    def surrogate(self, chunk: Rollout, k: int, out: StepOutput, old_log_prob: torch.Tensor, adv: torch.Tensor,
                  weight: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        scaled = adv if weight is None else adv * weight
        return weighted_clip_loss(out.log_prob, old_log_prob, scaled, self.tcfg.clip_range,
                                  self.step_weight(chunk, k))

    def kl_penalty(self, batch: StepBatch, unit: StepUnit, kl: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
        """With ``kl_mode: code``, the authors' TempFlow KL (:func:`step_variance_kl`), not flow_grpo's."""
        if self.tcfg.kl_mode == "code":
            sigmas = batch.chunks[unit.chunk].sigmas
            kl = step_variance_kl(kl, sigmas[unit.k].item(), sigmas[unit.k + 1].item())
        return super().kl_penalty(batch, unit, kl, active)
