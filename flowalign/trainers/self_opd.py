"""Self-OPD: teacher-free on-policy distillation from the policy's own branches (``docs/methods/self_opd.md``).

Per prompt, ``trunks`` rollouts of the current weights θ_old (the trunks: Flow-GRPO SDE rollouts at
``trunk_noise_level``, or ODE rollouts at 0). As the authors' mask does, a trunk whose reward equals its
prompt's mean is dropped (``drop_flat``: a prompt whose trunks all score alike is not branched), and as their
re-balancing does, randomly drawn dropped trunks are re-added until the kept count is a multiple of
``kept_multiple`` (:func:`readd_dropped`). At
``branch_steps`` steps k, drawn per training step and shared by its prompts (with the authors' weights
``step_weights``, early steps likelier), each kept trunk's state ``x_k`` is branched:

    x_det = x_k + (σ_{k+1} − σ_k)·v_old                     (the deterministic next state)
    x^j   = μ_old + τ·ξ_j,  j = 1 … K                       (the Flow-GRPO SDE step at x_k, ξ_j ~ N(0, I))

every branch is finished with the ODE sampler and scored; the deterministic branch's reward is the
baseline (the self-reference; an ODE trunk is its own deterministic branch, its reward the baseline). As the
authors' ``select_all_branches`` does, the M rewards are fused with their weights w_m first and the difference
is scaled by the spread of the candidates:

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
The hooks: the trunks, the branches and their rewards (``collect``), the attenuation and a global plan of
(trunk, step) units (``plan``), the loss of one unit (``loss``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import torch
from pydantic import Field, model_validator

from flowalign.limits import MAX_COEFFICIENT, MAX_GROUP_SIZE, MAX_SAMPLING_STEPS
from flowalign.sampling import continue_ode, sde_step
from flowalign.trainers.base import GroupTrainer, Plan, Sampling, StepBatch, derived_seed
from flowalign.trainers.options import InnerEpochOptions, SampleOptions, TrainerConfig


class SelfOPDConfig(TrainerConfig, SampleOptions, InnerEpochOptions):
    """``trunks`` rollouts per prompt (``SampleOptions``: trunks and branch continuations per batch, the
    trunks' steps and guidance) and their branch sets (no advantage kind: the advantages are the method's own,
    against the deterministic branch); ``inner_epochs`` optimiser steps on the same fixed targets."""

    name: Literal["self_opd"] = "self_opd"
    #: what runs saved before these options existed computed (see TrainerConfig.before)
    before = {"trunks": 1, "trunk_noise_level": 0.0, "drop_flat": False, "kept_multiple": 1}
    #: rollouts per prompt, each branched (the authors' num_image_per_prompt 16)
    trunks: int = Field(16, ge=1, le=MAX_GROUP_SIZE)
    #: a of the trunks' Flow-GRPO SDE, the last step included (the authors' trajectory_noise_level 0.7); 0: ODE
    #: trunks, each its own deterministic branch
    trunk_noise_level: float = Field(0.7, ge=0, le=2)
    #: drop a trunk whose reward equals its prompt's mean over the step (the authors' mask of zero advantages);
    #: needs trunks ≥ 2
    drop_flat: bool = True
    #: with drop_flat, re-add randomly drawn dropped trunks until the step's kept count is a multiple of this
    #: (the authors' re-balancing to sample.num_batches_per_epoch, 16 in their presets; none when no trunk is kept
    #: or too few were dropped); 1: the kept trunks alone
    kept_multiple: int = Field(16, ge=1, le=MAX_GROUP_SIZE)
    #: K: SDE candidates branched off each sampled state (1: a pairwise comparison with the deterministic branch)
    branches: int = Field(8, ge=1, le=MAX_GROUP_SIZE)
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

    @model_validator(mode="after")
    def _flat_needs_a_group(self) -> "SelfOPDConfig":
        if self.drop_flat and self.trunks < 2:
            raise ValueError("trainer.drop_flat=true drops every trunk when trainer.trunks=1 (a prompt's one trunk "
                             "is its own mean): set trunks to 2 or more, or drop_flat=false")
        return self


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


def differs_from_its_prompt(totals: torch.Tensor, valid: torch.Tensor, prompt_ids: torch.Tensor) -> torch.Tensor:
    """``(N,)`` whether each sample's fused reward ``totals (N,)`` differs from the mean of its prompt's valid
    samples (``prompt_ids (N,)``): the authors' mask, which drops a sample of zero group advantage (every
    sample of a prompt whose rewards all agree). An invalid sample is dropped."""
    totals, kept = totals.double(), torch.zeros_like(valid)  # float64, as their numpy statistics
    for p in torch.unique(prompt_ids):
        members = (prompt_ids == p) & valid
        if members.any():
            kept |= members & (totals != totals[members].mean())
    return kept


def readd_dropped(kept: torch.Tensor, multiple: int, generator: torch.Generator) -> torch.Tensor:
    """``(N,)`` the mask ``kept (N,)`` with randomly drawn dropped samples re-added until its count is a multiple
    of ``multiple``, as the authors' re-balancing after their mask (they reshape the kept samples into
    ``num_batches_per_epoch`` micro-batches): ``multiple − count % multiple`` of the dropped ones, the first of
    a ``torch.randperm`` over them (``generator``: the draw; theirs is the global RNG). Unchanged when nothing is
    kept (their epoch is skipped), when the count is already a multiple, or when too few were dropped."""
    kept = kept.clone()
    count = int(kept.sum())
    if count % multiple == 0:  # nothing kept (0) included: their epoch is skipped
        return kept
    dropped = torch.where(~kept)[0]
    need = multiple - count % multiple
    if len(dropped) >= need:
        kept[dropped[torch.randperm(len(dropped), generator=generator)[:need]]] = True
    return kept


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
    advantages ``(K,)``; ``key``: (trunk, k), its identity in any rank layout (trunk: group · trunks + member)."""

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
    """A step's trunks (the loop's :class:`StepBatch` of rollouts, scored) and the branch sets of those kept."""

    trunk: StepBatch
    sets: list[BranchSet]
    spare: BranchSet | None  # the step's first set drawn (perhaps padding): a rank with no set runs it as a filler
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
        return True  # the deterministic branches read the policy's velocity at every step

    @classmethod
    def rollouts_per_step(cls, tcfg: SelfOPDConfig) -> tuple[int, int, int]:
        return tcfg.prompts_per_step, tcfg.trunks, tcfg.num_steps

    @classmethod
    def step_holdings(cls, tcfg: SelfOPDConfig) -> Any:
        """What a step holds per prompt (a :class:`flowalign.plan_holdings.StepHoldings`). ``trunks`` rollouts a
        prompt, held through the update (their velocities kept). At each of the ``n`` branched states of every
        trunk, ``K = branches`` candidates (and, off an SDE trunk, the deterministic branch) are finished and
        decoded on the device; their decoded samples are kept in a list until every one is drawn (the last set
        is decoded while the others are held), then concatenated and scored: twice the candidates alive at the
        scoring peak. The branch sets themselves go to CPU memory."""
        from flowalign.plan_holdings import Holding, StepHoldings, self_opd_branched_steps

        per_state = tcfg.branches + (1 if tcfg.trunk_noise_level > 0 else 0)
        candidates = tcfg.trunks * self_opd_branched_steps(tcfg) * per_state
        trunk = Holding(rollouts=tcfg.trunks)
        return StepHoldings(trunk, (Holding(rollouts=tcfg.trunks, decoded=candidates, decoding=True),
                                    Holding(rollouts=tcfg.trunks, decoded=2 * candidates)))

    def sampling(self, group: int) -> Sampling:
        """Trunks keeping their velocities (v_old at the branched states needs no forward): the Flow-GRPO SDE on
        every step, the one to σ = 0 included, as the authors' trajectory; or the ODE."""
        if self.tcfg.trunk_noise_level == 0:
            return Sampling("ode", keep_velocities=True)
        return Sampling("flow_grpo", noise_level=self.tcfg.trunk_noise_level, sde_last_step=True,
                        keep_velocities=True)

    def branched_steps(self, step: int) -> list[int]:
        """The steps where every trunk of training step ``step`` is branched, keyed by (seed, step): the same
        for every prompt and rank, so every rank runs the same number of ODE passes (under fsdp each
        forward is a collective)."""
        high = max(1, min(self.tcfg.num_steps - 1, int(self.tcfg.num_steps * self.tcfg.max_step_fraction)))
        g = torch.Generator().manual_seed(derived_seed(self.cfg.run.seed, step, 23))
        return branched_step_draw(high, self.tcfg.branch_steps, self.tcfg.step_weights, g)

    def collect(self, step: int) -> BranchBatch:
        """``trunks`` rollouts per prompt (scored), the flat ones dropped, then K candidates at each branched
        step of every kept trunk, finished by the ODE (with, off an SDE trunk, its deterministic branch);
        every candidate of the step scored at once; advantages against the deterministic branch's reward."""
        idx, t = self.step_indices(step), self.tcfg
        p, n = t.prompts_per_step, t.trunks
        prompts = [self.data.prompts[i] for i in idx for _ in range(n)]
        metadata = [self.data.metadata[i] for i in idx for _ in range(n)]
        groups = torch.arange(self.rank * p, (self.rank + 1) * p).repeat_interleave(n)
        prompt_ids = torch.tensor(idx).repeat_interleave(n)
        trunk = self.sample(prompts, metadata, groups, prompt_ids, step)
        judged = self.judge(trunk.scores, trunk.samples, None, step)  # the invalid guard and the trunks' reward logs
        trunk = dataclasses.replace(trunk, logs={**trunk.logs, **judged.logs})
        work, kept_fraction = self.kept_trunks(trunk, step)
        logs = {**trunk.logs, "trunk/kept_fraction": kept_fraction}
        if not work:  # no trunk kept on any rank: the step is done
            return BranchBatch(trunk, [], None, {**logs, "branch/reward": float("nan"), "branch/adv_abs": 0.0,
                                                 "zero_adv_fraction": 1.0})
        deterministic = t.trunk_noise_level > 0  # an SDE trunk is not its own deterministic branch
        drawn, samples = [], []
        for c, i, m in work:
            g = trunk.groups[max(m, 0)]
            trunk_id = int(g) * n + int((trunk.groups[: max(m, 0)] == g).sum())  # global: the same in any rank layout
            for k in self.branched_steps(step):
                branch_set, decoded = self.branch(trunk, c, i, k, trunk_id, step, deterministic)
                drawn.append((branch_set, m))
                samples.append(decoded)
        # the candidates' rewards through the scoring service (the invalid guard over all of them); the
        # step's reward/* logs stay the trunks' (the policy's own samples)
        per_set = t.branches + int(deterministic)
        set_prompts = [trunk.chunks[s.chunk].prompts[s.sample] for s, _ in drawn]
        set_metadata = [trunk.chunks[s.chunk].metadata[s.sample] for s, _ in drawn]
        scores = self.score(torch.cat(samples), [q for q in set_prompts for _ in range(per_set)],
                            [d for d in set_metadata for _ in range(per_set)], step=step).scores
        sets, branch_totals = [], []
        for j, (s, m) in enumerate(drawn):
            if m < 0:
                continue  # padding
            first = j * per_set
            part = slice(first, first + t.branches)
            if deterministic:
                base, base_valid = scores.values[first + t.branches], bool(scores.valid[first + t.branches])
            else:
                base, base_valid = trunk.scores.values[m], bool(trunk.scores.valid[m])
            adv = self_reference_advantages(scores.values[part], scores.valid[part], base, base_valid,
                                            scores.weights, t.adv_eps)
            sets.append(dataclasses.replace(s, advantages=adv))
            branch_totals.append(scores.total[part][scores.valid[part]])
        adv = torch.cat([s.advantages for s in sets]) if sets else torch.zeros(0)
        totals = torch.cat(branch_totals) if branch_totals else torch.zeros(0)
        # over every rank's sets (ranks may keep different numbers of trunks)
        sums = torch.tensor(self.gather_objects((totals.sum().item(), len(totals), adv.abs().sum().item(),
                                                 (adv == 0).sum().item(), len(adv)))).sum(0).tolist()
        logs = {**logs, "branch/reward": sums[0] / sums[1] if sums[1] else float("nan"),
                "branch/adv_abs": sums[2] / sums[4] if sums[4] else 0.0,
                "zero_adv_fraction": sums[3] / sums[4] if sums[4] else 1.0}
        return BranchBatch(trunk, sets, drawn[0][0], logs)

    def kept_trunks(self, trunk: StepBatch, step: int) -> tuple[list[tuple[int, int, int]], float]:
        """``(chunk, sample, position in the step)`` of each trunk to branch, and the fraction kept over every
        rank. With ``drop_flat`` a trunk is kept when its reward differs from its prompt's mean over every
        rank's trunks (a prompt's trunks may be spread over ranks), then dropped ones are re-added until the
        step's count is a multiple of ``kept_multiple``: over every rank's trunks in global trunk order, drawn
        by a generator keyed by (seed, step), so any rank layout and a resumed run re-add the same trunks (the
        authors' re-balance each rank's own samples with the global RNG). Every rank branches as many trunks
        (scoring gathers every rank's candidates, and under fsdp each forward is a collective): the padding
        repeats the step's first trunk at position −1, and its sets are dropped after scoring."""
        n = len(trunk.groups)
        kept = torch.ones(n, dtype=torch.bool)
        if self.tcfg.drop_flat:
            kept = differs_from_its_prompt(self.gather(trunk.scores.total), self.gather(trunk.scores.valid),
                                           self.gather(trunk.prompt_ids))
            # gathered in rank order, each rank's trunks by (group, member): the global trunk order
            kept = readd_dropped(kept, self.tcfg.kept_multiple, torch.Generator().manual_seed(
                derived_seed(self.cfg.run.seed, step, 31)))[self.rank * n : (self.rank + 1) * n]
        at = [(c, i) for c, chunk in enumerate(trunk.chunks) for i in range(len(chunk))]
        real = [(c, i, m) for m, (c, i) in enumerate(at) if kept[m]]
        padding = [(0, 0, -1)] * (max(self.gather_objects(len(real))) - len(real))
        return real + padding, self.gather(kept.float()).mean().item()

    @torch.no_grad()
    def branch(self, trunk: StepBatch, c: int, i: int, k: int, trunk_id: int, step: int, deterministic: bool
               ) -> tuple[BranchSet, torch.Tensor]:
        """Trunk sample ``i`` of chunk ``c`` branched at step ``k``: K SDE candidates, each with its own noise keyed
        by (seed, step, trunk, k, j), and with ``deterministic`` the ODE step last, finished in ODE batches of
        ``batch_size``; the set (advantages not yet known: zeros) and the decoded samples ``(K [+ 1], ...)``."""
        chunk, t = trunk.chunks[c], self.tcfg
        x_k, v = chunk.latents[i : i + 1, k], chunk.velocities[i : i + 1, k]
        sigma, sigma_next = chunk.sigmas[k].item(), chunk.sigmas[k + 1].item()
        gaussian = sde_step("flow_grpo", v, x_k, sigma, sigma_next, noise_level=t.noise_level, prev_sample=x_k)
        noise = torch.stack([torch.randn(x_k.shape[1:], generator=torch.Generator().manual_seed(
            derived_seed(self.cfg.run.seed, step, trunk_id, k, j, 29))) for j in range(t.branches)])
        std = float(gaussian.std.flatten()[0])
        branches = gaussian.mean + std * noise.to(gaussian.mean)
        starts = torch.cat([branches, x_k + (sigma_next - sigma) * v]) if deterministic else branches
        finals = torch.cat([continue_ode(self.policy, part, chunk.sigmas[k + 1 :], chunk.cond[[i] * len(part)],
                                         chunk.guidance_scale) for part in starts.split(t.batch_size)])
        branch_set = BranchSet(c, i, k, (trunk_id, k), x_k.cpu(), gaussian.mean.cpu(), std, branches.cpu(),
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
        """A branch set with zero weights (fsdp padding; its loss is multiplied by 0)."""
        s = batch.spare
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
