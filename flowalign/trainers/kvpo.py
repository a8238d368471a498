"""KVPO (*KVPO: ODE-Native GRPO for Autoregressive Video Alignment via KV Semantic Exploration*;
``docs/methods/kvpo.md``) for streaming policies that can route their history
(:meth:`flowalign.protocols.StreamingPolicy.history_cache`).

Exploration moves the *history*, not the noise. Per prompt, every branch starts from the same initial noise
and the same deterministic stream up to a chunk ``k``; at chunk ``k`` branch ``i`` attends to a random subset
``H_i`` of the earlier chunks' keys and values (each kept with probability ``keep_prob``, the first chunk —
the attention sink — always with ``keep_sink``), then the stream finishes with its full history. Every branch
is a deterministic ODE rollout under a context the model could have been given, so branches differ in what
they continue from, not in injected noise.

The policy over branches is the Trajectory Velocity Energy surrogate. With ``x_t^i`` branch ``i``'s states over
chunk ``k``'s jumps and ``u_t^i = (x_{t+1}^i − x_t^i)/(σ_{t+1} − σ_t)`` the velocities it took, and ``v_θ`` the
policy's velocity with the *full* history,

    E_i(θ) = mean_t mean_D (v_θ(x_t^i, σ_t → σ_{t+1} | full) − sg(u_t^i))²,    π_θ(i) = softmax_i(−E_i / τ)
    L      = −(1/G) Σ_i min(r_i·A_i, clip(r_i, 1 ± ε)·A_i),    r_i = π_θ(i) / π_old(i)

With group advantages summing to zero the gradient at ``r = 1`` is ``(1/(Gτ)) Σ_i A_i ∇E_i``: the full-history
velocity field moves toward the velocities of the branches that scored well and away from those that did
not, in velocity space and on the states the model itself visited (no SDE surrogate). A branch whose routing
kept every entry is the policy's own trajectory: its energy is zero.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from pydantic import Field

from flowalign.config import StepIndex
from flowalign.errors import UserError
from flowalign.limits import MAX_COEFFICIENT
from flowalign.sampling.streaming import StreamPrefix, stream_rollout
from flowalign.trainers.base import GroupTrainer, Plan, derived_seed
from flowalign.trainers.options import AdvantageOptions, StreamOptions, TrainerConfig
from flowalign.trainers.parts.policy_gradient import clipped_loss
from flowalign.trainers.parts.units import GroupUnit


class KVPOConfig(TrainerConfig, StreamOptions, AdvantageOptions):
    """KVPO's own routed branches (``StreamOptions``), scored into group advantages."""

    name: Literal["kvpo"] = "kvpo"
    #: probability that a history chunk stays in a branch's KV cache at the routed chunk
    keep_prob: float = Field(0.5, ge=0, le=1)
    #: always keep the first chunk (the attention sink streaming models rely on)
    keep_sink: bool = True
    #: τ of the surrogate softmax(−E/τ), E a per-element mean squared velocity difference
    temperature: float = Field(0.05, gt=0, le=MAX_COEFFICIENT)
    #: ε of the clipped ratio
    clip_range: float = Field(0.2, gt=0, le=MAX_COEFFICIENT)
    #: chunks whose history may be routed (default: every chunk with a history, 1..K−1)
    route_chunks: list[StepIndex] | None = None
    advantage: str = Field("group", pattern="^(group|global_std|gdpo)$")


# ---------------------------------------------------------------------------------------------- the math


def draw_routing(chunk: int, keep_prob: float, keep_sink: bool, generator: torch.Generator) -> tuple[int, ...]:
    """The history chunks ``0..chunk−1`` one branch keeps: each with probability ``keep_prob``, chunk 0 always
    when ``keep_sink``."""
    kept = (torch.rand(chunk, generator=generator) < keep_prob).tolist()
    return tuple(j for j in range(chunk) if kept[j] or (keep_sink and j == 0))


def velocity_energy(v: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Trajectory Velocity Energy ``(G,)``: ``mean_{t,D} (v − sg(u))²`` of the policy's velocities ``v (G, T, ...)``
    against the branches' own ``u (G, T, ...)``."""
    return ((v - u.detach()) ** 2).flatten(1).mean(1)


def taken_velocities(states: torch.Tensor, sigmas: torch.Tensor) -> torch.Tensor:
    """``u_t = (x_{t+1} − x_t)/(σ_{t+1} − σ_t)`` ``(G, T, ...)`` of deterministic trajectories ``states (G, T+1, ...)``."""
    steps = (sigmas[1:] - sigmas[:-1]).to(states).view(1, -1, *[1] * (states.ndim - 2))
    return (states[:, 1:] - states[:, :-1]) / steps


# ---------------------------------------------------------------------------------------------- the trainer


@dataclass
class BranchGroup:
    """One prompt's branches at chunk ``chunk``: the shared prefix ``(1, C, F_{<k}, H, W)``, each branch's chunk
    states ``(G, T+1, C, f_k, H, W)`` and routing, advantages ``(G,)`` and ``log π_old (G,)``."""

    prompt: str
    chunk: int
    prefix: torch.Tensor
    states: torch.Tensor
    routings: list[tuple[int, ...]]
    advantages: torch.Tensor
    old_log_probs: torch.Tensor


@dataclass
class BranchBatch:
    groups: list[BranchGroup]
    logs: dict[str, float] = field(default_factory=dict)


class KVPOTrainer(GroupTrainer):
    Config = KVPOConfig
    tcfg: KVPOConfig
    sampler = "ode"

    def __init__(self, *args: Any, **kw: Any):
        super().__init__(*args, **kw)
        if not hasattr(self.policy, "history_cache"):
            raise UserError(f"trainer.name=kvpo routes a streaming video model's KV cache, but model.path holds a "
                            f"{self.policy.family!r} model; use a streaming family whose policy routes its history "
                            "(such as AnyFlow-FAR)")
        chunks = len(self.policy.chunk_frames)
        routable = list(range(1, chunks)) if self.tcfg.route_chunks is None else list(self.tcfg.route_chunks)
        bad = [k for k in routable if not 1 <= k < chunks]
        if bad or not routable:
            raise UserError(f"trainer.route_chunks={self.tcfg.route_chunks}: this model streams {chunks} chunks; "
                            f"a routed chunk needs a history, so give indices in 1..{chunks - 1}")
        self.route_chunks = routable

    def guidance(self) -> float:
        g = self.tcfg.guidance_scale
        return float(self.policy.defaults.get("guidance_scale", 1.0) if g is None else g)

    def energies(self, group: BranchGroup) -> torch.Tensor:
        """``E_i (G,)`` of the group's branches under the current weights, the full-history cache of the prefix
        re-encoded without gradient; differentiable in the weights."""
        policy, guidance, tc = self.policy, self.guidance(), self.tcfg
        cond = policy.encode([group.prompt] * len(group.states))
        cache = policy.history_cache(group.prefix.to(policy.device), range(group.chunk), cond[[0]], guidance)
        cache = cache.repeat_interleave(len(group.states))
        sigmas = policy.sigmas(tc.num_steps).float()
        states = group.states.to(policy.device)
        v = torch.stack([policy.chunk_velocity(states[:, t], sigmas[t].item(), sigmas[t + 1].item(), cache, cond, guidance)
                         for t in range(tc.num_steps)], dim=1)
        return velocity_energy(v, taken_velocities(states, sigmas))

    def collect(self, step: int) -> BranchBatch:
        """Per prompt: the deterministic stream to a routed chunk, G branches that attend to random subsets of
        its history there, their rewards, advantages and ``π_old``."""
        tc, g, policy, guidance = self.tcfg, self.tcfg.group_size, self.policy, self.guidance()
        prompts, metadata, groups = self.step_prompts(step)
        firsts = list(range(0, len(prompts), g))
        noise = torch.cat([policy.initial_noise(1, torch.Generator().manual_seed(
            derived_seed(self.cfg.run.seed, step, int(groups[i]), 0, 91))) for i in firsts])
        center = stream_rollout(policy, [prompts[i] for i in firsts], num_steps=tc.num_steps, guidance_scale=guidance,
                                initial_noise=noise, decode=False)
        branched, samples, kept = [], [], []
        for j, i in enumerate(firsts):
            rng = torch.Generator().manual_seed(derived_seed(self.cfg.run.seed, step, int(groups[i]), 0, 93))
            k = self.route_chunks[int(torch.randint(len(self.route_chunks), (1,), generator=rng))]
            prefix = center.prefix(k, [j])
            cond = policy.encode([prompts[i]])
            routings, states = [], []
            for _ in range(g):
                keep = draw_routing(k, tc.keep_prob, tc.keep_sink, rng)
                routed = StreamPrefix(prefix.clean, policy.history_cache(prefix.clean, keep, cond, guidance))
                branch = stream_rollout(policy, [prompts[i]], num_steps=tc.num_steps, guidance_scale=guidance,
                                        initial_noise=noise[j:j + 1], prefix=routed, decode=False)
                with torch.no_grad():
                    samples.append(policy.decode(branch.final_latents))
                routings.append(keep)
                states.append(branch.chunks[k][0])
                kept.append(len(keep) / k)
            branched.append((prompts[i], k, prefix.clean.cpu(), torch.stack(states).cpu(), routings))
        prompt_ids = torch.tensor(self.step_indices(step)).repeat_interleave(g)
        scored = self.score(torch.cat(samples), prompts, metadata, prompt_ids, step)
        batch, energy = [], []
        for j, parts in enumerate(branched):
            group = BranchGroup(*parts, scored.advantages[j * g:(j + 1) * g].float(), torch.zeros(g))
            with torch.no_grad():
                e = self.energies(group)  # π_old: the energies at the weights that sampled the branches
            batch.append(dataclasses.replace(group, old_log_probs=torch.log_softmax(-e / tc.temperature, dim=0).cpu()))
            energy.append(e.mean().item())
        logs = {**scored.logs, "kvpo/kept_fraction": sum(kept) / len(kept), "kvpo/energy": sum(energy) / len(energy)}
        return BranchBatch(batch, logs)

    def plan(self, batch: BranchBatch, generator: torch.Generator) -> Plan:
        """One optimiser step over every group, a unit each."""
        total = self.total(len(batch.groups))
        return Plan([[GroupUnit(i, total) for i in range(len(batch.groups))]], global_weights=True)

    def loss(self, batch: BranchBatch, unit: GroupUnit) -> tuple[torch.Tensor, dict[str, float]]:
        group = batch.groups[unit.index]
        energy = self.energies(group)
        log_probs = torch.log_softmax(-energy / self.tcfg.temperature, dim=0)
        old = group.old_log_probs.to(log_probs)
        loss = clipped_loss(log_probs, old, group.advantages.to(log_probs), self.tcfg.clip_range)
        ratio = torch.exp(log_probs.detach() - old)
        return loss / unit.total, {"kvpo_loss": loss.item(), "ratio_dev": (ratio - 1).abs().max().item()}
