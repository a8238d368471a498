"""AR-CoPO (*AR-CoPO: Align Autoregressive Video Generation with Contrastive Policy Optimization*, arXiv
2603.17461; ``docs/methods/ar_copo.md``) for streaming policies (:class:`flowalign.protocols.StreamingPolicy`).

Per prompt, a centre stream is sampled with the deterministic few-step sampler and forked at a random chunk
``k`` (the pivot): ``G`` candidates share every chunk before ``k`` (its clean latents and KV cache), start chunk
``k`` from neighbours of the centre's noise ``ε_c``,

    ε_i = √(1 − σ²)·ε_c + σ·ξ_i,        ξ_i ~ N(0, I),

and finish the stream deterministically with the centre's noise for the later chunks, so each candidate's
sequence-level reward ``R_i`` is the consequence of its chunk ``k``; ``A_i`` its group advantage. The policy over
candidates is Neighbor GRPO's contrastive surrogate, per denoising step ``t`` of chunk ``k`` (``anchor:
candidates``, the paper's): ``anchors`` candidates ``a`` are drawn per group (symmetric anchor sampling), and with
``x̂0_t^(i)`` each candidate's clean prediction from its state ``x_t^(i)`` at collection and ``x̂0_t^(θ,a)`` the
current weights' from the anchor's state,

    d_t^(i|a) = mean_D (x̂0_t^(θ,a) − sg(x̂0_t^(i)))²,   π_θ(i | s_t, a) = softmax_i(−d_t^(i|a) / τ)
    L = −mean_{a,t,i} min(r·A_i, clip(r, 1 ± ε)·A_i),   r = π_θ(i | s_t, a) / π_old(i | s_t, a)

(``π_old`` is the same with the anchor's own prediction at collection). ``anchor: center`` is the former form:
one policy per group, ``d_i`` between the chunk the current weights make from ``ε_c`` (every jump
differentiated) and the candidates' clean chunks. Semi-on-policy (``replay: reference``): a buffer of
``buffer_size`` groups sampled by the starting weights, replayed with their ``π_old``, the ratio clip as the trust
region; ``replay: recent`` is the former first-in first-out buffer mixed into on-policy steps.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import torch
from pydantic import Field, model_validator

from flowalign.config import StepIndex
from flowalign.errors import UserError
from flowalign.limits import MAX_COEFFICIENT, MAX_GROUP_SIZE, MAX_LR, MAX_UPDATES, MAX_WEIGHT_COPIES
from flowalign.sampling.streaming import StreamPrefix, stream_rollout
from flowalign.trainers.base import GroupTrainer, Plan, derived_seed
from flowalign.trainers.options import AdvantageOptions, StreamOptions, TrainerConfig
from flowalign.trainers.parts import stream_calls
from flowalign.trainers.parts.policy_gradient import clipped_loss


class ARCoPOConfig(TrainerConfig, StreamOptions, AdvantageOptions):
    """AR-CoPO's own fork rollouts (``StreamOptions``), scored into group advantages. The defaults are the
    paper's (its experiments: G = 12, lr 1e-5, σ = 0.5, clip 1e-4, 4 anchors, 2 policy updates, 100 groups)."""

    name: Literal["ar_copo"] = "ar_copo"
    #: what runs saved before these options existed computed (see TrainerConfig.before)
    before: ClassVar[dict[str, Any]] = {"anchor": "center", "updates": 1, "replay": "recent"}
    #: G candidates per fork (the paper's 12)
    group_size: int = Field(12, ge=2, le=MAX_GROUP_SIZE)
    #: AdamW learning rate (the paper's 1e-5)
    lr: float = Field(1e-5, gt=0, le=MAX_LR)
    #: σ: how far a candidate's chunk noise is from the centre's (ε_i = √(1−σ²)·ε_c + σ·ξ_i; the paper's 0.5)
    neighborhood: float = Field(0.5, gt=0, le=1)
    #: τ of the contrastive policy softmax(−d/τ), d a per-element mean squared distance (the paper's squared
    #: norm with τ₀ = τ·D, D the chunk's elements)
    temperature: float = Field(0.05, gt=0, le=MAX_COEFFICIENT)
    #: ε of the clipped ratio (the paper's 1e-4)
    clip_range: float = Field(1e-4, gt=0, le=MAX_COEFFICIENT)
    #: "candidates": the paper's surrogate, per denoising step t of the fork chunk, anchored at `anchors`
    #: candidates drawn per group (symmetric anchor sampling), d the distance between the current weights'
    #: clean prediction from the anchor's stored state and each candidate's prediction at collection;
    #: "center": the former form, the chunk the current weights make from the centre's noise (every jump
    #: differentiated) against the candidates' clean chunks, one policy per group
    anchor: Literal["candidates", "center"] = "candidates"
    #: candidates: B, the anchors drawn per group and update (the paper's 4); at most group_size
    anchors: int = Field(4, ge=1, le=MAX_GROUP_SIZE)
    #: optimiser steps per collected batch, the batch's units (a group's anchor each, or a group under
    #: anchor: center) dealt round-robin into them (the paper's 2 policy updates per iteration; 1: the former)
    updates: int = Field(2, ge=1, le=MAX_UPDATES)
    #: chunks a fork may be drawn at (default: every chunk)
    fork_chunks: list[StepIndex] | None = None
    #: semi-on-policy: groups drawn from the replay buffer per step (0: on-policy only)
    replay_groups: int = Field(0, ge=0, le=MAX_WEIGHT_COPIES)
    #: groups the replay buffer keeps (the paper's 100)
    buffer_size: int = Field(100, ge=1, le=MAX_WEIGHT_COPIES)
    #: "reference": the paper's semi-on-policy run, the buffer filled once with buffer_size groups sampled by the
    #: starting weights and every step trained on replay_groups of them only (no fresh groups); "recent": the
    #: former form, every collected group enters a first-in first-out buffer and each step adds replay_groups
    #: of them to its fresh groups
    replay: Literal["reference", "recent"] = "reference"
    advantage: str = Field("group", pattern="^(group|global_std|gdpo)$")
    #: candidates of a group streamed at once (None: the whole group); fewer hold fewer streams' KV caches
    #: (the same candidates: each stream's noise and draws are its own)
    fork_batch: int | None = Field(None, ge=1, le=MAX_GROUP_SIZE)

    @model_validator(mode="after")
    def _anchors_within_the_group(self) -> "ARCoPOConfig":
        if self.anchor == "candidates" and self.anchors > self.group_size:
            raise ValueError(f"trainer.anchors={self.anchors}: anchors are drawn from the group's "
                             f"{self.group_size} candidates; give at most trainer.group_size")
        return self


# ---------------------------------------------------------------------------------------------- the math


def neighbours(center: torch.Tensor, beta: float, generator: torch.Generator, n: int) -> torch.Tensor:
    """``n`` noises ``(n, ...)`` around ``center (...)``: ``√(1−β²)·ε_c + β·ξ_i`` (each still N(0, I) when ε_c is)."""
    xi = torch.randn((n, *center.shape), generator=generator, dtype=torch.float32).to(center.device)
    return math.sqrt(1 - beta**2) * center[None] + beta * xi


def contrastive_log_probs(y: torch.Tensor, candidates: torch.Tensor, temperature: float) -> torch.Tensor:
    """``log π(i) (..., G)`` of candidates ``(G, *D)`` given the policy's own output ``y (..., *D)`` (any
    leading dims, e.g. anchors): ``log_softmax_i(−mean_D (y − y_i)² / τ)`` (the candidates are constants)."""
    lead = y.dim() - (candidates.dim() - 1)
    diff = y.unsqueeze(lead) - candidates.detach()
    d = (diff**2).flatten(lead + 1).mean(-1)
    return torch.log_softmax(-d / temperature, dim=-1)


def anchored_log_probs(anchor_x0: torch.Tensor, candidate_x0: torch.Tensor, temperature: float) -> torch.Tensor:
    """The paper's per-step surrogate policy ``log π(i | s_t, k) (B, T, G)``: ``anchor_x0 (B, T, *D)`` the clean
    predictions made from the anchors' states at each step, ``candidate_x0 (G, T, *D)`` the candidates' own
    predictions at collection; per step, ``log_softmax_i(−mean_D (x̂0_t^(k) − x̂0_t^(i))² / τ)``."""
    diff = anchor_x0[:, None] - candidate_x0.detach()[None]  # (B, G, T, *D)
    d = (diff**2).flatten(3).mean(-1).transpose(1, 2)  # (B, T, G)
    return torch.log_softmax(-d / temperature, dim=-1)


def x0_predictions(policy: Any, states: torch.Tensor, sigmas: torch.Tensor, cache: Any, cond: Any,
                   guidance: float, checkpointed: bool = False) -> torch.Tensor:
    """``x̂0 (B, T, *D)`` of a chunk's states ``(B, ≥T, *D)`` at the grid ``sigmas (T+1,)``: the jump from each
    state straight to σ = 0, ``x_t − σ_t·v(x_t, σ_t → 0)`` (a flow-map model's mean velocity to 0; a plain flow's
    instantaneous one)."""
    out = []
    for t in range(len(sigmas) - 1):
        s = sigmas[t].item()
        v = stream_calls.chunk_velocity(policy, checkpointed, states[:, t], s, 0.0, cache, cond, guidance)
        out.append(states[:, t] - s * v)
    return torch.stack(out, dim=1)


# ---------------------------------------------------------------------------------------------- the trainer


@dataclass
class ForkGroup:
    """One prompt's fork: the prefix before chunk ``chunk`` (clean latents ``(1, C, F_{<k}, H, W)``), the centre's
    chunk noise ``(1, C, f_k, H, W)``, the candidates' chunk ``(G, C, f_k, H, W)``, their advantages ``(G,)`` and
    ``log π_old``: ``(G,)`` under ``anchor: center``; under ``anchor: candidates`` ``(G, T, G)`` (anchor, step,
    candidate), with the candidates' trajectories ``states (G, T+1, C, f_k, H, W)`` and their clean predictions at
    collection ``x0 (G, T, C, f_k, H, W)``."""

    prompt: str
    chunk: int
    prefix: torch.Tensor
    center: torch.Tensor
    candidates: torch.Tensor
    advantages: torch.Tensor
    old_log_probs: torch.Tensor
    states: torch.Tensor | None = None
    x0: torch.Tensor | None = None


#: the tensors a ForkGroup holds (those that are None under a form are not saved)
GROUP_TENSORS = ("prefix", "center", "candidates", "advantages", "old_log_probs", "states", "x0")


@dataclass
class ForkUnit:
    """Group ``index`` of the batch with its ``anchors`` (None under ``anchor: center``), weighted over the
    ``total`` units of its optimiser step on every rank."""

    index: int
    total: int
    anchors: tuple[int, ...] | None = None


@dataclass
class ForkBatch:
    groups: list[ForkGroup]
    logs: dict[str, float] = field(default_factory=dict)
    #: how many of ``groups`` (the first) were sampled this step; the rest are replayed from the buffer
    fresh: int = 0


class ARCoPOTrainer(GroupTrainer):
    Config = ARCoPOConfig
    tcfg: ARCoPOConfig
    sampler = "ode"

    def __init__(self, *args: Any, **kw: Any):
        super().__init__(*args, **kw)
        if not getattr(self.policy, "streaming", False):
            raise UserError(f"trainer.name=ar_copo forks a streaming video model chunk by chunk, but model.path holds "
                            f"a {self.policy.family!r} model; use a streaming family (one whose policy generates chunk by chunk "
                            "with a KV cache, such as AnyFlow-FAR)")
        if self.tcfg.anchor == "center" and getattr(self.policy, "own_sampler", ("ode",))[0] != "ode":
            raise UserError("trainer.anchor=center replays the fork chunk's deterministic path, but this model "
                            "re-noises every step with fresh noise (its own sampler); use trainer.anchor=candidates")
        chunks = len(self.policy.chunk_frames)
        self.fork_chunks = list(range(chunks)) if self.tcfg.fork_chunks is None else list(self.tcfg.fork_chunks)
        bad = [k for k in self.fork_chunks if not 0 <= k < chunks]
        if bad or not self.fork_chunks:
            raise UserError(f"trainer.fork_chunks={self.tcfg.fork_chunks}: this model streams {chunks} chunks "
                            f"(0..{chunks - 1}); give chunk indices in that range")
        self.buffer: list[ForkGroup] = []

    @classmethod
    def training_chunks(cls, tcfg: ARCoPOConfig, checkpointed: bool) -> int:
        """A unit's forwards of the fork chunk, a call a step: the anchors' stored states (``anchor: candidates``,
        ``anchors`` rows a call) or the chunk's chain of jumps from the centre's noise (``center``, one row);
        checkpointed, one call at a time."""
        rows = tcfg.anchors if tcfg.anchor == "candidates" else 1
        return rows * (1 if checkpointed else tcfg.num_steps)

    @classmethod
    def step_holdings(cls, tcfg: ARCoPOConfig) -> Any:
        """What a step holds per prompt (a :class:`flowalign.plan_holdings.StepHoldings`): the centre stream (its
        chunks' latents, conditioning and KV caches) while the forks stream ``fork_batch`` candidates at a time
        (over the step's prompts, each with its caches) and are decoded; the decoded candidates kept in a list,
        then concatenated and scored (``2G``). The groups go to CPU memory: nothing of the step stays on the
        device through the update."""
        from flowalign.plan_holdings import Holding, StepHoldings

        forks = (tcfg.fork_batch or tcfg.group_size) / tcfg.prompts_per_step
        return StepHoldings(Holding(), (Holding(rollouts=1 + forks, decoded=tcfg.group_size, decoding=True),
                                        Holding(rollouts=1, decoded=2 * tcfg.group_size)))

    def guidance(self) -> float:
        g = self.tcfg.guidance_scale
        return float(self.policy.defaults.get("guidance_scale", 1.0) if g is None else g)

    def _stream(self, prompts: list[str], noise: torch.Tensor, prefix: StreamPrefix | None = None,
                draw_keys: list[int] | None = None, keep_caches: Collection[int] | None = None) -> Any:
        return stream_rollout(self.policy, prompts, num_steps=self.tcfg.num_steps, guidance_scale=self.guidance(),
                              initial_noise=noise, prefix=prefix, decode=False, draw_keys=draw_keys,
                              keep_caches=keep_caches)

    def forks(self, step: int) -> tuple[list[ForkGroup], dict[str, float]]:
        """Per prompt of ``step``: the centre stream, a fork chunk, G neighbour candidates from the centre's prefix,
        their rewards and group advantages, and ``π_old`` at the weights that sampled them."""
        tc, g, policy = self.tcfg, self.tcfg.group_size, self.policy
        prompts, metadata, groups = self.step_prompts(step)
        firsts = list(range(0, len(prompts), g))
        centers = torch.cat([policy.initial_noise(1, torch.Generator().manual_seed(
            derived_seed(self.cfg.run.seed, step, int(groups[i]), 0, 81))) for i in firsts])
        rngs = [torch.Generator().manual_seed(derived_seed(self.cfg.run.seed, step, int(groups[i]), 0, 83))
                for i in firsts]
        chosen = [self.fork_chunks[int(torch.randint(len(self.fork_chunks), (1,), generator=r))] for r in rngs]
        # the centre keeps the caches its candidates fork from, a candidate the one its replay reads
        center = self._stream([prompts[i] for i in firsts], centers, keep_caches=set(chosen))
        noises, forks, prefixes = [], [], []
        for j, i in enumerate(firsts):
            rng, k = rngs[j], chosen[j]
            part = policy.chunk_slice(k)
            noise = centers[j:j + 1].repeat(g, 1, 1, 1, 1)
            noise[:, :, part] = neighbours(centers[j, :, part], tc.neighborhood, rng, g)
            noises.append(noise)
            forks.append(k)
            prefixes.append(center.prefix(k, [j]))
        samples, candidates, states, x0 = [], [], [], []
        sigmas = policy.sigmas(tc.num_steps).float()
        per = tc.fork_batch or g
        for j, i in enumerate(firsts):
            group_states, group_x0, group_chunks = [], [], []
            for start in range(0, g, per):
                part = range(start, min(start + per, g))
                # a re-noising sampler's draws are the centre's for every candidate (the paper's shared solver noise)
                keys = None if center.draw_keys is None else [center.draw_keys[j]] * len(part)
                fork = self._stream([prompts[i + c] for c in part], noises[j][part.start:part.stop],
                                    prefixes[j].repeat_interleave(len(part)), keys, keep_caches=(forks[j],))
                with torch.no_grad():
                    samples.append(policy.decode(fork.final_latents))
                    if tc.anchor == "candidates":
                        path = fork.chunks[forks[j]].to(policy.device)
                        group_x0.append(x0_predictions(policy, path, sigmas, fork.caches[forks[j]], fork.cond,
                                                       self.guidance()).float().cpu())
                        group_states.append(path.cpu())
                group_chunks.append(fork.chunks[forks[j]][:, -1])
            if group_states:
                states.append(torch.cat(group_states))
                x0.append(torch.cat(group_x0))
            candidates.append(torch.cat(group_chunks))
        prompt_ids = torch.tensor(self.step_indices(step)).repeat_interleave(g)
        scored = self.score(torch.cat(samples), prompts, metadata, prompt_ids, step)
        advantages = scored.advantages
        batch = []
        for j, i in enumerate(firsts):
            if tc.anchor == "candidates":  # π_old(i | s_t, k): anchor k's own prediction is its x̂0 at collection
                old = anchored_log_probs(x0[j], x0[j], tc.temperature)
            else:
                old = contrastive_log_probs(center.chunks[forks[j]][j, -1], candidates[j], tc.temperature)
            center_noise = centers[j:j + 1, :, policy.chunk_slice(forks[j])]
            batch.append(ForkGroup(prompts[i], forks[j], prefixes[j].clean.cpu(), center_noise.cpu(),
                                   candidates[j].cpu(), advantages[i:i + g].float(), old.cpu(),
                                   states[j] if states else None, x0[j] if x0 else None))
        return batch, {**scored.logs, "ar_copo/fork_chunk": sum(forks) / len(forks)}

    def collect(self, step: int) -> ForkBatch:
        """``replay: recent`` (or on-policy): this step's forks, plus ``replay_groups`` earlier groups of the
        buffer they then enter. ``replay: reference`` with ``replay_groups``: the buffer is filled once with
        ``buffer_size`` groups sampled by the starting weights, and each step trains on ``replay_groups`` of them."""
        tc = self.tcfg
        if tc.replay == "reference" and tc.replay_groups > 0:
            fill = 0
            while len(self.buffer) < tc.buffer_size:  # before any update: the reference (starting) weights
                groups, logs = self.forks(step + fill)
                self.buffer = (self.buffer + groups)[:tc.buffer_size]
                fill += 1
            replay = self._replay(step)
            return ForkBatch(replay, {"ar_copo/replayed": float(len(replay))}, fresh=0)
        batch, logs = self.forks(step)
        replay = self._replay(step)
        self.buffer = (self.buffer + batch)[-tc.buffer_size:]
        logs["ar_copo/replayed"] = float(len(replay))
        return ForkBatch(batch + replay, logs, fresh=len(batch))

    def _replay(self, step: int) -> list[ForkGroup]:
        """``replay_groups`` groups drawn from the buffer (without repeats)."""
        n = min(self.tcfg.replay_groups, len(self.buffer))
        if n == 0:
            return []
        rng = torch.Generator().manual_seed(derived_seed(self.cfg.run.seed, step, self.rank, 0, 89))
        return [self.buffer[i] for i in torch.randperm(len(self.buffer), generator=rng)[:n].tolist()]

    def plan(self, batch: ForkBatch, generator: torch.Generator) -> Plan:
        """``anchor: candidates``: each group's ``anchors`` drawn without repeats (symmetric anchor sampling), a
        unit each; ``center``: a unit a group. The units dealt round-robin into ``updates`` optimiser steps."""
        tc = self.tcfg
        units: list[tuple[int, tuple[int, ...] | None]] = []
        for i, group in enumerate(batch.groups):
            if tc.anchor == "candidates":
                drawn = torch.randperm(len(group.advantages), generator=generator)[:tc.anchors].tolist()
                units += [(i, (a,)) for a in drawn]
            else:
                units.append((i, None))
        # every rank has as many units (same prompts per step, anchors, replay), so as many steps of each size
        n = min(tc.updates, len(units))
        steps = [units[s::n] for s in range(n)]
        totals = [self.total(len(step)) for step in steps]
        return Plan([[ForkUnit(i, total, anchors) for i, anchors in step] for step, total in zip(steps, totals)],
                    global_weights=True)

    def chunk_output(self, group: ForkGroup) -> torch.Tensor:
        """``anchor: center``'s ``y_θ (C, f_k, H, W)``: chunk ``k`` made from the centre's noise by the current
        weights, every jump differentiated; the prefix's cache (context) is re-encoded without gradient."""
        policy, guidance = self.policy, self.guidance()
        cond = policy.encode([group.prompt])
        cache = self.prefix_cache(group, cond)
        sigmas = policy.sigmas(self.tcfg.num_steps).float()
        x = group.center.to(policy.device, non_blocking=True)
        for i in range(len(sigmas) - 1):
            s, s_next = sigmas[i].item(), sigmas[i + 1].item()
            x = x + (s_next - s) * stream_calls.chunk_velocity(policy, self.cfg.model.gradient_checkpointing, x, s,
                                                               s_next, cache, cond, guidance)
        return x[0]

    def prefix_cache(self, group: ForkGroup, cond: Any) -> Any:
        """The cache the fork chunk reads, made again from the stored clean prefix (batch 1, without gradient)."""
        prefix = group.prefix.to(self.policy.device, non_blocking=True)
        with torch.no_grad():
            return self.policy.history_cache(prefix, range(group.chunk), cond, self.guidance())

    def anchor_predictions(self, group: ForkGroup, anchors: list[int]) -> torch.Tensor:
        """``x̂0_θ (B, T, C, f_k, H, W)``: the current weights' clean prediction from each anchor's stored state at
        every step of the fork chunk, each differentiated (one forward a step, not through the chain)."""
        policy, guidance = self.policy, self.guidance()
        cond = policy.encode([group.prompt] * len(anchors))
        cache = self.prefix_cache(group, cond[[0]]).repeat_interleave(len(anchors))
        states = group.states[anchors].to(policy.device, non_blocking=True)
        return x0_predictions(policy, states, policy.sigmas(self.tcfg.num_steps).float(), cache, cond, guidance,
                              self.cfg.model.gradient_checkpointing)

    def loss(self, batch: ForkBatch, unit: ForkUnit) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        group, tc = batch.groups[unit.index], self.tcfg
        if unit.anchors is None:
            y = self.chunk_output(group)
            log_probs = contrastive_log_probs(y, group.candidates.to(y, non_blocking=True), tc.temperature)
            old = group.old_log_probs.to(y, non_blocking=True)
            advantages = group.advantages.to(y, non_blocking=True)
        else:
            anchors = list(unit.anchors)
            x0 = self.anchor_predictions(group, anchors)
            log_probs = anchored_log_probs(x0, group.x0.to(x0, non_blocking=True), tc.temperature)  # (B, T, G)
            old = group.old_log_probs[anchors].to(x0, non_blocking=True)
            advantages = group.advantages.to(x0, non_blocking=True).expand_as(log_probs)
        loss = clipped_loss(log_probs, old, advantages, tc.clip_range)
        ratio = torch.exp(log_probs.detach() - old)
        deviation = (ratio - 1).abs().max()
        fresh = unit.index < batch.fresh  # a fresh group's ratio is on-policy (1 up to kernel noise)
        return loss / unit.total, {"ar_copo_loss": loss.detach(),
                                   ("ratio_dev" if fresh else "ratio_dev_replayed"): deviation}

    # ------------------------------------------------------------------ the buffer travels with checkpoints
    def state_dict(self) -> dict[str, Any]:
        tensors = {f"buffer.{i}.{name}": getattr(g, name) for i, g in enumerate(self.buffer)
                   for name in GROUP_TENSORS if getattr(g, name) is not None}
        return {**tensors, "buffer_prompts": [g.prompt for g in self.buffer], "buffer_chunks": [g.chunk for g in self.buffer]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        def tensor(i: int, name: str) -> torch.Tensor | None:
            t = state.get(f"buffer.{i}.{name}")
            return None if t is None else t.clone()

        self.buffer = [ForkGroup(prompt, int(chunk), *(tensor(i, name) for name in GROUP_TENSORS))
                       for i, (prompt, chunk) in enumerate(zip(state["buffer_prompts"], state["buffer_chunks"]))]
