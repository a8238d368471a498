"""AR-CoPO (*AR-CoPO: Align Autoregressive Video Generation with Contrastive Policy Optimization*;
``docs/methods/ar_copo.md``) for streaming policies (:class:`flowalign.protocols.StreamingPolicy`).

Per prompt, a centre stream is sampled with the deterministic few-step sampler and forked at a random chunk
``k``: ``G`` candidates share every chunk before ``k`` (its clean latents and KV cache), start chunk ``k`` from
neighbours of the centre's noise ``ε_c``,

    ε_i = √(1 − β²)·ε_c + β·ξ_i,        ξ_i ~ N(0, I),

and finish the stream deterministically with the centre's noise for the later chunks, so each candidate's
sequence-level reward ``R_i`` is the consequence of its chunk ``k``. The policy over candidates is Neighbor
GRPO's contrastive surrogate: with ``y_θ`` the chunk ``k`` the current weights make from ``ε_c`` (every
few-step jump differentiated) and ``y_i`` the candidates' chunk ``k``,

    d_i = mean_D (y_θ − sg(y_i))²,   π_θ(i) = softmax_i(−d_i / τ),   r_i = π_θ(i) / π_old(i)
    L   = −(1/G) Σ_i min(r_i·A_i, clip(r_i, 1 ± ε)·A_i),      A_i the group advantage of R_i

a GRPO update localised to the forked chunk: with Σ A_i = 0 its gradient at r = 1 is ``(1/(Gτ)) Σ_i A_i ∇d_i``,
pulling ``y_θ`` toward the better candidates and away from the worse. Semi-on-policy: every collected group
enters a replay buffer (``buffer_size``); each step also trains on ``replay_groups`` groups drawn from it,
their ``π_old`` the one stored at collection (the clip bounds how far an old group moves the weights) and
their prefix cache re-encoded with the current weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from pydantic import Field

from flowalign.config import StepIndex
from flowalign.errors import UserError
from flowalign.limits import MAX_COEFFICIENT, MAX_WEIGHT_COPIES
from flowalign.sampling.streaming import StreamPrefix, stream_rollout
from flowalign.trainers.base import GroupTrainer, Plan, derived_seed
from flowalign.trainers.options import AdvantageOptions, StreamOptions, TrainerConfig
from flowalign.trainers.parts.policy_gradient import clipped_loss
from flowalign.trainers.parts.units import GroupUnit


class ARCoPOConfig(TrainerConfig, StreamOptions, AdvantageOptions):
    """AR-CoPO's own fork rollouts (``StreamOptions``), scored into group advantages."""

    name: Literal["ar_copo"] = "ar_copo"
    #: β: how far a candidate's chunk noise is from the centre's (ε_i = √(1−β²)·ε_c + β·ξ_i)
    neighborhood: float = Field(0.3, gt=0, le=1)
    #: τ of the contrastive policy softmax(−d/τ), d a per-element mean squared distance
    temperature: float = Field(0.05, gt=0, le=MAX_COEFFICIENT)
    #: ε of the clipped ratio
    clip_range: float = Field(0.2, gt=0, le=MAX_COEFFICIENT)
    #: chunks a fork may be drawn at (default: every chunk)
    fork_chunks: list[StepIndex] | None = None
    #: semi-on-policy: groups of earlier steps replayed per step beside the fresh ones (0: on-policy only)
    replay_groups: int = Field(0, ge=0, le=MAX_WEIGHT_COPIES)
    #: groups the replay buffer keeps (the oldest leave first)
    buffer_size: int = Field(16, ge=1, le=MAX_WEIGHT_COPIES)
    advantage: str = Field("group", pattern="^(group|global_std|gdpo)$")


# ---------------------------------------------------------------------------------------------- the math


def neighbours(center: torch.Tensor, beta: float, generator: torch.Generator, n: int) -> torch.Tensor:
    """``n`` noises ``(n, ...)`` around ``center (...)``: ``√(1−β²)·ε_c + β·ξ_i`` (each still N(0, I) when ε_c is)."""
    xi = torch.randn((n, *center.shape), generator=generator, dtype=torch.float32).to(center.device)
    return math.sqrt(1 - beta**2) * center[None] + beta * xi


def contrastive_log_probs(y: torch.Tensor, candidates: torch.Tensor, temperature: float) -> torch.Tensor:
    """``log π(i) (G,)`` of candidates ``(G, ...)`` given the policy's own output ``y (...)``:
    ``log_softmax_i(−mean_D (y − y_i)² / τ)`` (the candidates are constants)."""
    d = ((y[None] - candidates.detach()) ** 2).flatten(1).mean(1)
    return torch.log_softmax(-d / temperature, dim=0)


# ---------------------------------------------------------------------------------------------- the trainer


@dataclass
class ForkGroup:
    """One prompt's fork: the prefix before chunk ``chunk`` (clean latents ``(1, C, F_{<k}, H, W)``), the centre's
    chunk noise ``(1, C, f_k, H, W)``, the candidates' chunk ``(G, C, f_k, H, W)``, their advantages ``(G,)`` and
    ``log π_old (G,)``."""

    prompt: str
    chunk: int
    prefix: torch.Tensor
    center: torch.Tensor
    candidates: torch.Tensor
    advantages: torch.Tensor
    old_log_probs: torch.Tensor


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
        chunks = len(self.policy.chunk_frames)
        self.fork_chunks = list(range(chunks)) if self.tcfg.fork_chunks is None else list(self.tcfg.fork_chunks)
        bad = [k for k in self.fork_chunks if not 0 <= k < chunks]
        if bad or not self.fork_chunks:
            raise UserError(f"trainer.fork_chunks={self.tcfg.fork_chunks}: this model streams {chunks} chunks "
                            f"(0..{chunks - 1}); give chunk indices in that range")
        self.buffer: list[ForkGroup] = []

    def guidance(self) -> float:
        g = self.tcfg.guidance_scale
        return float(self.policy.defaults.get("guidance_scale", 1.0) if g is None else g)

    def _stream(self, prompts: list[str], noise: torch.Tensor, prefix: StreamPrefix | None = None) -> Any:
        return stream_rollout(self.policy, prompts, num_steps=self.tcfg.num_steps, guidance_scale=self.guidance(),
                              initial_noise=noise, prefix=prefix, decode=False)

    def collect(self, step: int) -> ForkBatch:
        """Per prompt: the centre stream, a fork chunk, G neighbour candidates from the centre's prefix, their
        rewards and group advantages, and ``π_old`` at the weights that sampled them."""
        tc, g = self.tcfg, self.tcfg.group_size
        prompts, metadata, groups = self.step_prompts(step)
        firsts = list(range(0, len(prompts), g))
        centers = torch.cat([self.policy.initial_noise(1, torch.Generator().manual_seed(
            derived_seed(self.cfg.run.seed, step, int(groups[i]), 0, 81))) for i in firsts])
        center = self._stream([prompts[i] for i in firsts], centers)
        noises, forks, prefixes = [], [], []
        for j, i in enumerate(firsts):
            rng = torch.Generator().manual_seed(derived_seed(self.cfg.run.seed, step, int(groups[i]), 0, 83))
            k = self.fork_chunks[int(torch.randint(len(self.fork_chunks), (1,), generator=rng))]
            part = self.policy.chunk_slice(k)
            noise = centers[j:j + 1].repeat(g, 1, 1, 1, 1)
            noise[:, :, part] = neighbours(centers[j, :, part], tc.neighborhood, rng, g)
            noises.append(noise)
            forks.append(k)
            prefixes.append(center.prefix(k, [j]))
        samples, candidates = [], []
        for j, i in enumerate(firsts):
            fork = self._stream(prompts[i:i + g], noises[j], prefixes[j].repeat_interleave(g))
            with torch.no_grad():
                samples.append(self.policy.decode(fork.final_latents))
            candidates.append(fork.chunks[forks[j]][:, -1])
        prompt_ids = torch.tensor(self.step_indices(step)).repeat_interleave(g)
        scored = self.score(torch.cat(samples), prompts, metadata, prompt_ids, step)
        advantages = scored.advantages
        batch = []
        for j, i in enumerate(firsts):
            y = center.chunks[forks[j]][j, -1]
            old = contrastive_log_probs(y, candidates[j], tc.temperature)
            center_noise = centers[j:j + 1, :, self.policy.chunk_slice(forks[j])]
            batch.append(ForkGroup(prompts[i], forks[j], prefixes[j].clean.cpu(), center_noise.cpu(),
                                   candidates[j].cpu(), advantages[i:i + g].float(), old.cpu()))
        logs = {**scored.logs, "ar_copo/fork_chunk": sum(forks) / len(forks)}
        replay = self._replay(step)
        self.buffer = (self.buffer + batch)[-tc.buffer_size:]
        logs["ar_copo/replayed"] = float(len(replay))
        return ForkBatch(batch + replay, logs, fresh=len(batch))

    def _replay(self, step: int) -> list[ForkGroup]:
        """``replay_groups`` groups of earlier steps drawn from the buffer (without repeats)."""
        n = min(self.tcfg.replay_groups, len(self.buffer))
        if n == 0:
            return []
        rng = torch.Generator().manual_seed(derived_seed(self.cfg.run.seed, step, self.rank, 0, 89))
        return [self.buffer[i] for i in torch.randperm(len(self.buffer), generator=rng)[:n].tolist()]

    def plan(self, batch: ForkBatch, generator: torch.Generator) -> Plan:
        """One optimiser step over every group (fresh and replayed), a unit each."""
        total = self.total(len(batch.groups))
        return Plan([[GroupUnit(i, total) for i in range(len(batch.groups))]], global_weights=True)

    def chunk_output(self, group: ForkGroup) -> torch.Tensor:
        """``y_θ (C, f_k, H, W)``: chunk ``k`` made from the centre's noise by the current weights, every jump
        differentiated; the prefix's cache (context) is re-encoded without gradient."""
        policy, guidance = self.policy, self.guidance()
        cond = policy.encode([group.prompt])
        cache = policy.empty_cache(1, guidance)
        prefix = group.prefix.to(policy.device, non_blocking=True)
        for k in range(group.chunk):
            cache = policy.append_chunks(cache, prefix[:, :, :policy.chunk_slice(k).stop], cond, guidance)
        sigmas = policy.sigmas(self.tcfg.num_steps).float()
        x = group.center.to(policy.device, non_blocking=True)
        for i in range(len(sigmas) - 1):
            s, s_next = sigmas[i].item(), sigmas[i + 1].item()
            x = x + (s_next - s) * policy.chunk_velocity(x, s, s_next, cache, cond, guidance)
        return x[0]

    def loss(self, batch: ForkBatch, unit: GroupUnit) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        group = batch.groups[unit.index]
        y = self.chunk_output(group)
        log_probs = contrastive_log_probs(y, group.candidates.to(y, non_blocking=True), self.tcfg.temperature)
        old = group.old_log_probs.to(y, non_blocking=True)
        loss = clipped_loss(log_probs, old, group.advantages.to(y, non_blocking=True), self.tcfg.clip_range)
        ratio = torch.exp(log_probs.detach() - old)
        deviation = (ratio - 1).abs().max()
        fresh = unit.index < batch.fresh  # a fresh group's ratio is on-policy (1 up to kernel noise)
        return loss / unit.total, {"ar_copo_loss": loss.detach(),
                                   ("ratio_dev" if fresh else "ratio_dev_replayed"): deviation}

    # ------------------------------------------------------------------ the buffer travels with checkpoints
    def state_dict(self) -> dict[str, Any]:
        tensors = {f"buffer.{i}.{name}": getattr(g, name) for i, g in enumerate(self.buffer)
                   for name in ("prefix", "center", "candidates", "advantages", "old_log_probs")}
        return {**tensors, "buffer_prompts": [g.prompt for g in self.buffer], "buffer_chunks": [g.chunk for g in self.buffer]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.buffer = [ForkGroup(prompt, int(chunk), *(state[f"buffer.{i}.{name}"].clone() for name in
                                                        ("prefix", "center", "candidates", "advantages", "old_log_probs")))
                       for i, (prompt, chunk) in enumerate(zip(state["buffer_prompts"], state["buffer_chunks"]))]
