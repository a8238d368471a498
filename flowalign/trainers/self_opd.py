"""Self-OPD: teacher-free on-policy distillation from the policy's own branches (``docs/methods/self_opd.md``).

Per prompt, one ODE rollout of the current weights θ_old (the trunk); at ``branch_steps`` steps k, drawn
per training step and shared by its prompts (with the authors' weights ``step_weights``, early steps
likelier), the trunk's state ``x_k`` is branched:

    x_det = x_k + (σ_{k+1} − σ_k)·v_old                     (the deterministic next state: the trunk itself)
    x^j   = μ_old + τ·ξ_j,  j = 1 … K                       (the Flow-GRPO SDE step at x_k, ξ_j ~ N(0, I))

every branch is finished with the ODE sampler and scored; the deterministic branch's reward is the
baseline (the self-reference). As the authors' ``select_all_branches`` does, the M rewards are fused with
their weights w_m first and the difference is scaled by the spread of the candidates:

    R_j = Σ_m w_m R^m(x^j),   A_j = (R_j − R(x_det)) / max(std_j R_j, ε)          (unbiased std over the K)

The student's step mean ``μ_θ`` at ``x_k`` is pulled toward branches with A_j > 0 and pushed from those
with A_j < 0 (:func:`pull_push_loss`, SDE-variance normalised by τ²), each push scaled by
``(1 − cos(δ_j, δ_best))/2``, its direction's disagreement with the best branch's, and every weight
clipped to ``±branch_weight_clip`` (:func:`pull_push_weights`):

    L = (1/K) Σ_j ω_j · mean_D(μ_θ − x^j)² / (2τ²)

At θ = θ_old the gradient is ``−(1/(K·τ·D)) Σ_j ω_j ξ_j · ∂μ/∂θ``: descent moves μ along the
advantage-weighted branch noise. With K = 1 the spread is 0 (A = ±(R_1 − R_det)/ε): the one candidate
is pulled at full weight when it beats the deterministic branch; a losing one is its own best branch and
gets no push.
The hooks: the trunk, the branches and their rewards (``collect``), the attenuation and a global plan of
(prompt, step) units (``plan``), the loss of one unit (``loss``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import torch
from pydantic import Field

from flowalign.limits import MAX_COEFFICIENT, MAX_GROUP_SIZE, MAX_SAMPLING_STEPS
from flowalign.sampling import continue_ode, sde_step
from flowalign.trainers.base import GroupTrainer, Plan, Sampling, StepBatch, derived_seed
from flowalign.trainers.options import InnerEpochOptions, SampleOptions, TrainerConfig


class SelfOPDConfig(TrainerConfig, SampleOptions, InnerEpochOptions):
    """One ODE trunk per prompt (``SampleOptions``: trunks and branch continuations per ODE batch, the trunks'
    steps and guidance) and its branch sets (no prompt groups, no advantage kind: the advantages are the
    method's own, against the trunk); ``inner_epochs`` optimiser steps on the same fixed targets."""

    name: Literal["self_opd"] = "self_opd"
    #: K: SDE candidates branched off each sampled state (1: a pairwise comparison with the deterministic branch)
    branches: int = Field(4, ge=1, le=MAX_GROUP_SIZE)
    #: sampled states branched per prompt and step (distinct steps of the trunk; the authors' timesteps_per_step)
    branch_steps: int = Field(2, ge=1, le=MAX_SAMPLING_STEPS)
    #: branched steps are drawn from {0 … ⌊T·max_step_fraction⌋ − 1}, and never the step to σ = 0
    max_step_fraction: float = Field(0.99, gt=0, le=1)
    #: relative odds of branching at step 0, 1, … (steps past the list: 0), drawn without replacement; the
    #: authors' timestep_weights; empty: every step alike
    step_weights: list[Annotated[float, Field(ge=0, le=MAX_COEFFICIENT)]] = Field(
        default_factory=lambda: [10.0, 9.0, 8.0, 7.0, 6.0, 4.0, 2.0, 1.0, 0.0], max_length=MAX_SAMPLING_STEPS)
    #: a of the Flow-GRPO SDE step that draws the candidates (0.7 on SD3.5)
    noise_level: float = Field(0.7, gt=0, le=2)
    #: scale each push by (1 − cos(its branch offset, the best branch's))/2; false: pushes at full weight
    attenuation: bool = True
    #: the least the candidates' reward spread is taken to be, A = ΔR / max(std, adv_eps)
    adv_eps: float = Field(1e-4, gt=0, le=MAX_COEFFICIENT)
    #: every branch weight ω is clipped to ±branch_weight_clip
    branch_weight_clip: float = Field(1.0, gt=0, le=MAX_COEFFICIENT)


# ---------------------------------------------------------------------------------------------- the loss


def self_reference_advantages(values: torch.Tensor, valid: torch.Tensor, base: torch.Tensor, base_valid: bool,
                              weights: torch.Tensor, eps: float = 1e-4) -> torch.Tensor:
    """The K branches' advantages ``(K,)`` against the deterministic branch.

    ``values (K, M)``: each branch's M rewards; ``valid (K,)``; ``base (M,)``: the deterministic branch's;
    ``weights (M,)``. The rewards are fused first, ``R_j = Σ_m w_m R^m_j``, then
    ``A_j = (R_j − R_base) / max(std_{valid j} R_j, eps)`` (unbiased std; 0 below two valid branches); an
    invalid branch gets 0, and every branch gets 0 when the baseline is invalid (nothing to compare with).
    """
    k = values.shape[0]
    dtype = torch.promote_types(values.dtype, torch.float32)
    if not base_valid or not valid.any():
        return torch.zeros(k, dtype=dtype)
    w = weights.to(dtype)
    fused, fused_base = values.to(dtype) @ w, base.to(dtype) @ w
    spread = fused[valid].std() if int(valid.sum()) > 1 else torch.zeros((), dtype=dtype)
    adv = (fused - fused_base) / spread.clamp(min=eps)
    return torch.where(valid, adv, torch.zeros_like(adv))


def pull_push_weights(advantages: torch.Tensor, offsets: torch.Tensor, attenuate: bool = True,
                      clip: float = 1.0) -> torch.Tensor:
    """``ω (K,)``, the authors' direction-aware weights: ``A_j`` for a pulling branch (A_j ≥ 0),
    ``A_j·(1 − cos(δ_j, δ_best))/2`` for a pushing one, with ``δ_j = x^j − μ_old`` ``(K, ...)`` the branch
    offsets and ``best`` the branch of the highest advantage (a winner or the least bad loser); then
    clipped to ``±clip``. A push along the best branch's direction would also drive the student away from
    it, so it is scaled toward 0; one pointing the opposite way keeps its full weight."""
    adv = advantages.to(torch.promote_types(advantages.dtype, torch.float32))
    if not attenuate:
        return adv.clamp(-clip, clip)
    unit = torch.nn.functional.normalize(offsets.to(adv).flatten(1), dim=1)
    cos = unit @ unit[int(adv.max(0).indices)]  # the first of tied bests, as torch.max picks it
    return torch.where(adv < 0, adv * 0.5 * (1 - cos), adv).clamp(-clip, clip)


def pull_push_loss(mean: torch.Tensor, branches: torch.Tensor, std: float | torch.Tensor,
                   weights: torch.Tensor) -> torch.Tensor:
    """``L = (1/K) Σ_j ω_j · mean_D(μ_θ − x^j)² / (2τ²)`` (scalar): ``mean (1, ...)`` the student's step mean,
    ``branches (K, ...)`` the candidates ``x^j``, ``std`` τ of the step that drew them, ``weights (K,)``."""
    dtype = torch.promote_types(mean.dtype, torch.float32)
    diff = mean.to(dtype) - branches.to(dtype, non_blocking=True)
    tau = torch.as_tensor(std, dtype=dtype).to(diff.device, non_blocking=True)
    sq = diff.pow(2).flatten(1).mean(1) / (2 * tau**2)
    return (weights.to(sq, non_blocking=True) * sq).mean()


def branched_step_draw(high: int, count: int, weights: list[float], generator: torch.Generator) -> list[int]:
    """``count`` distinct steps of ``0 … high−1`` (sorted), drawn without replacement with the odds ``weights``
    (steps past the list: 0; fewer when fewer have positive odds), as the authors' ``torch.multinomial`` of
    the normalised float32 weights; every step alike when ``weights`` is empty."""
    if not weights:
        return sorted(torch.randperm(high, generator=generator)[:count].tolist())
    w = torch.tensor((list(weights) + [0.0] * high)[:high], dtype=torch.float32)
    if not (w > 0).any():
        return []
    w = w / w.sum()
    return sorted(torch.multinomial(w, min(count, int((w > 0).sum())), replacement=False, generator=generator).tolist())


# ---------------------------------------------------------------------------------------------- hooks


@dataclass(frozen=True)
class BranchSet:
    """Trunk sample ``sample`` of rollout batch ``chunk`` branched at step ``k``: the state ``x_k (1, ...)``,
    the old step mean ``mean (1, ...)`` and std ``std``, the K candidates ``branches (K, ...)`` and their
    advantages ``(K,)``; ``key``: (group, k), its identity in any rank layout."""

    chunk: int
    sample: int
    k: int
    key: tuple[int, int]
    x_k: torch.Tensor = field(compare=False)
    mean: torch.Tensor = field(compare=False)
    std: float = field(compare=False)
    branches: torch.Tensor = field(compare=False)
    advantages: torch.Tensor = field(compare=False)


@dataclass
class BranchBatch:
    """A step's trunks (the loop's :class:`StepBatch` of ODE rollouts, scored: the deterministic branches) and
    their branch sets."""

    trunk: StepBatch
    sets: list[BranchSet]
    logs: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class PullPushUnit:
    """A branch set with its pull-push weights ``ω (K,)``; one of ``of`` units over all ranks."""

    set: BranchSet
    weights: torch.Tensor
    of: int


class SelfOPDTrainer(GroupTrainer):
    Config = SelfOPDConfig
    tcfg: SelfOPDConfig
    sampler = "ode"

    @classmethod
    def keeps_velocities(cls, tcfg) -> bool:
        return True  # the branches' targets read the policy's velocity at every step

    @classmethod
    def step_holdings(cls, tcfg: SelfOPDConfig) -> Any:
        """What a step holds per prompt (a :class:`flowalign.plan_holdings.StepHoldings`). One ODE trunk a prompt, held through the update (its velocities kept). At each of the ``n`` branched
        states, ``K = branches`` candidates are finished and decoded on the device; their decoded samples are
        kept in a list until every one is drawn (the last set is decoded while the others are held), then
        concatenated and scored: ``2·n·K`` decoded samples alive at the scoring peak. The branch sets themselves
        go to CPU memory."""
        from flowalign.plan_holdings import Holding, StepHoldings, self_opd_branched_steps

        candidates = self_opd_branched_steps(tcfg) * tcfg.branches
        trunk = Holding(rollouts=1)
        return StepHoldings(trunk, (Holding(rollouts=1, decoded=candidates, decoding=True),
                                    Holding(rollouts=1, decoded=2 * candidates)))

    def sampling(self, group: int) -> Sampling:
        """Trunks: ODE rollouts keeping their velocities (v_old at the branched states needs no forward)."""
        return Sampling("ode", keep_velocities=True)

    def branched_steps(self, step: int) -> list[int]:
        """The steps where every trunk of training step ``step`` is branched, keyed by (seed, step): the same
        for every prompt and rank, so every rank runs the same number of ODE passes (under fsdp each
        forward is a collective)."""
        high = max(1, min(self.tcfg.num_steps - 1, int(self.tcfg.num_steps * self.tcfg.max_step_fraction)))
        g = torch.Generator().manual_seed(derived_seed(self.cfg.run.seed, step, 23))
        return branched_step_draw(high, self.tcfg.branch_steps, self.tcfg.step_weights, g)

    def collect(self, step: int) -> BranchBatch:
        """One trunk per prompt (scored: the baselines), then K candidates at each branched step, finished
        by the ODE; every candidate of the step scored at once; advantages against the trunk's reward."""
        idx = self.step_indices(step)
        p, t = self.tcfg.prompts_per_step, self.tcfg
        groups = torch.arange(self.rank * p, (self.rank + 1) * p)
        prompts = [self.data.prompts[i] for i in idx]
        metadata = [self.data.metadata[i] for i in idx]
        trunk = self.sample(prompts, metadata, groups, torch.tensor(idx), step)
        judged = self.judge(trunk.scores, trunk.samples, None, step)  # the invalid guard and the trunks' reward logs
        trunk = dataclasses.replace(trunk, logs={**trunk.logs, **judged.logs})
        drawn, samples = [], []
        n = 0
        for c, chunk in enumerate(trunk.chunks):
            for i in range(len(chunk)):
                group = int(trunk.groups[n])
                for k in self.branched_steps(step):
                    branch_set, decoded = self.branch(trunk, c, i, k, group, step)
                    drawn.append((branch_set, n))
                    samples.append(decoded)
                n += 1
        # the candidates' rewards through the scoring service (the invalid guard over all of them); the
        # step's reward/* logs stay the trunks' (the policy's own samples)
        branch_prompts = [trunk.chunks[s.chunk].prompts[s.sample] for s, _ in drawn for _ in range(t.branches)]
        branch_metadata = [trunk.chunks[s.chunk].metadata[s.sample] for s, _ in drawn for _ in range(t.branches)]
        scores = self.score(torch.cat(samples), branch_prompts, branch_metadata, step=step).scores
        base, sets = trunk.scores, []
        for j, (s, n) in enumerate(drawn):
            part = slice(j * t.branches, (j + 1) * t.branches)
            adv = self_reference_advantages(scores.values[part], scores.valid[part], base.values[n],
                                            bool(base.valid[n]), scores.weights, t.adv_eps)
            sets.append(dataclasses.replace(s, advantages=adv))
        adv = torch.cat([s.advantages for s in sets])
        logs = {**trunk.logs,
                "branch/reward": scores.total[scores.valid].mean().item() if scores.valid.any() else float("nan"),
                "branch/adv_abs": adv.abs().mean().item(), "zero_adv_fraction": (adv == 0).float().mean().item()}
        return BranchBatch(trunk, sets, logs)

    @torch.no_grad()
    def branch(self, trunk: StepBatch, c: int, i: int, k: int, group: int, step: int
               ) -> tuple[BranchSet, torch.Tensor]:
        """Trunk sample ``i`` of chunk ``c`` branched at step ``k``: K SDE candidates, each with its own noise keyed
        by (seed, step, group, k, j), finished in ODE batches of ``batch_size``; the set (advantages not yet
        known: zeros) and the candidates' decoded samples ``(K, ...)``."""
        chunk, t = trunk.chunks[c], self.tcfg
        x_k, v = chunk.latents[i : i + 1, k], chunk.velocities[i : i + 1, k]
        sigma, sigma_next = chunk.sigmas[k].item(), chunk.sigmas[k + 1].item()
        gaussian = sde_step("flow_grpo", v, x_k, sigma, sigma_next, noise_level=t.noise_level, prev_sample=x_k)
        noise = torch.stack([torch.randn(x_k.shape[1:], generator=torch.Generator().manual_seed(
            derived_seed(self.cfg.run.seed, step, group, k, j, 29))) for j in range(t.branches)])
        std = float(gaussian.std.flatten()[0])
        branches = gaussian.mean + std * noise.to(gaussian.mean)
        finals = torch.cat([continue_ode(self.policy, part, chunk.sigmas[k + 1 :], chunk.cond[[i] * len(part)],
                                         chunk.guidance_scale) for part in branches.split(t.batch_size)])
        branch_set = BranchSet(c, i, k, (group, k), x_k.cpu(), gaussian.mean.cpu(), std, branches.cpu(),
                               torch.zeros(t.branches))
        return branch_set, self.policy.decode(finals)

    def plan(self, batch: BranchBatch, generator: torch.Generator) -> Plan:
        """Every branch set with a non-zero advantage and its pull-push weights (fixed at θ_old), in each of
        ``inner_epochs`` optimiser steps, each unit weighted by 1 / the number of units over all ranks."""
        units = []
        for s in batch.sets:
            if s.advantages.abs().sum() > 0:
                weights = pull_push_weights(s.advantages, s.branches - s.mean, self.tcfg.attenuation,
                                            self.tcfg.branch_weight_clip)
                units.append(PullPushUnit(s, weights, 0))
        total = self.total(len(units))
        units = [dataclasses.replace(u, of=total) for u in units]
        return Plan([units] * self.tcfg.inner_epochs if total else [], global_weights=True)

    def filler(self, batch: BranchBatch, update: int) -> PullPushUnit:
        """The first branch set with zero weights (fsdp padding; its loss is multiplied by 0)."""
        s = batch.sets[0]
        return PullPushUnit(s, torch.zeros(len(s.advantages)), 1)

    def loss(self, batch: BranchBatch, unit: PullPushUnit) -> tuple[torch.Tensor, dict[str, Any]]:
        s = unit.set
        chunk = batch.trunk.chunks[s.chunk]
        x_k = s.x_k.to(self.policy.device, non_blocking=True)
        sigma, sigma_next = chunk.sigmas[s.k].item(), chunk.sigmas[s.k + 1].item()
        v = self.policy.velocity(x_k, sigma, chunk.cond[[s.sample]], chunk.guidance_scale)
        mean = sde_step("flow_grpo", v, x_k, sigma, sigma_next, noise_level=self.tcfg.noise_level,
                        prev_sample=x_k).mean
        loss = pull_push_loss(mean, s.branches.to(mean, non_blocking=True), s.std, unit.weights)
        info = {"pull_push_loss": loss.detach(), "mean_shift": (mean.detach() - s.mean.to(mean, non_blocking=True)).pow(2).mean()}
        return loss / unit.of, info
