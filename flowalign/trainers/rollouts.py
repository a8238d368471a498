"""The loop's default batch: a step's prompts → grouped rollouts → rewards → advantages.

Rollouts run in batches of ``trainer.batch_size`` samples whatever the group size (a batch may hold
several prompt groups; only samples whose :class:`Sampling` is equal share one). Every sample draws its
initial noise and SDE noise from its own generator keyed by ``(run seed, step, group, member)``, so a
sample is the same whatever the batching or the rank layout (up to the last-bit rounding of CPU kernels
that some batch sizes pick: ~1e-6 between a sample alone and in company). Rewards of batch i are scored in a worker
thread while batch i+1 samples, so a slow reward costs ``max(sample, reward)``, not the sum; while the
last batch is scored, the trainer's ``prepare`` hook does the update's work that reads no reward.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from flowalign.advantages import compute_advantages
from flowalign.errors import UserError
from flowalign.finite import check_training_finite
from flowalign.reward_set import RewardScores, RewardSet
from flowalign.sampling import CompressedTail, Rollout, rollout


def derived_seed(*parts: int) -> int:
    """A 63-bit seed from integers, stable across processes (no ``hash()``)."""
    return int(np.random.SeedSequence([abs(int(p)) for p in parts]).generate_state(2, dtype=np.uint64)[0] >> 1)


@dataclass(frozen=True)
class Sampling:
    """How one prompt group is rolled out (samples share a rollout batch only when these are equal).

    ``sampler``: a kind of :func:`flowalign.sampling.sde_step` or a step function (compare it by value,
    e.g. a frozen dataclass, so equal groups batch together); ``sde_window``: ``(start, width)`` or None
    (every step); ``sde_last_step``: whether the step to σ = 0 is stochastic too; ``keep_velocities``,
    ``keep_unconditional``: what the rollout stores besides latents and log-probs (see :func:`rollout`);
    ``grid``, ``timestep_form``: an authors' σ grid and the timestep form the transformer reads (None: the
    policy's own grid and timestep); ``tail``: the ODE after the window on a compressed grid (MixGRPO-Flash).
    """

    sampler: str | Callable[..., Any] = "flow_grpo"
    noise_level: float | None = None
    sde_window: tuple[int, int] | None = None
    sde_last_step: bool = False
    keep_velocities: bool = False
    cps_log_prob: str = "code"
    keep_unconditional: bool = False
    grid: Callable[[int], Any] | None = None
    timestep_form: Callable[[Any], Any] | None = None
    tail: CompressedTail | None = None


@dataclass
class StepBatch:
    """One step's rollouts on this rank, in the batches they were sampled in, and what the loop learnt
    about them.

    ``groups (N,)``: global group id of each sample (batch order); ``prompt_ids (N,)``: the prompt's
    index in the data (advantages are normalised per prompt); ``scores``: rewards; ``advantages (N,)``
    (0 for invalid samples); ``logs``: scalars for the step's log line; ``prepared``: what the trainer's
    ``prepare`` hook returned while the rewards were scored (None: nothing). The loop fills it; trainers
    read it (what one computes per batch travels in its plan's units or its own batch type).
    """

    chunks: list[Rollout]
    groups: torch.Tensor
    prompt_ids: torch.Tensor | None = None
    scores: RewardScores | None = None
    advantages: torch.Tensor | None = None
    logs: dict[str, float] = field(default_factory=dict)
    prepared: Any = None

    @property
    def samples(self) -> torch.Tensor:
        return torch.cat([c.samples for c in self.chunks])

    @property
    def prompts(self) -> list[str]:
        return [p for c in self.chunks for p in c.prompts]

    @property
    def metadata(self) -> list[dict[str, Any]]:
        return [m for c in self.chunks for m in c.metadata]

    def chunk_keys(self) -> list[tuple[int, int]]:
        """Each chunk's identity whatever the rank layout: ``(group, member)`` of its first sample."""
        seen: dict[int, int] = {}
        members = []
        for g in self.groups.tolist():
            members.append(seen.get(g, 0))
            seen[g] = members[-1] + 1
        starts = np.cumsum([0] + [len(c) for c in self.chunks[:-1]])
        return [(int(self.groups[s]), members[s]) for s in starts.tolist()]

    def per_chunk(self, values: torch.Tensor) -> list[torch.Tensor]:
        """Split a per-sample tensor ``(N, ...)`` by chunk."""
        return list(torch.split(values, [len(c) for c in self.chunks]))


@dataclass
class SampleSlot:
    """One sample to draw: its prompt, group, member index and generator; ``prefix`` ``(k + 1, ...)``: the states
    ``x_T … x_k`` of an ODE trajectory it leaves at step ``k`` (None: it starts at ``x_T``)."""

    prompt: str
    metadata: dict[str, Any]
    group: int
    prompt_id: int
    generator: torch.Generator
    initial_noise: torch.Tensor | None
    prefix: torch.Tensor | None = None


def rollout_batches(slots: list[SampleSlot], sampling: dict[int, Sampling], batch_size: int) -> list[list[SampleSlot]]:
    """Consecutive samples of equal :class:`Sampling` (and prefix length) in batches of at most ``batch_size``."""
    buckets: dict[tuple[Sampling, int], list[SampleSlot]] = {}
    for slot in slots:
        buckets.setdefault((sampling[slot.group], 0 if slot.prefix is None else len(slot.prefix)), []).append(slot)
    return [bucket[i : i + batch_size] for bucket in buckets.values() for i in range(0, len(bucket), batch_size)]


def sample_slots(policy: Any, prompts: list[str], metadata: list[dict], groups: torch.Tensor,
                 prompt_ids: torch.Tensor, seed: int, step: int, shared_initial_noise: bool) -> list[SampleSlot]:
    """A generator per sample keyed by (seed, step, group, member); under ``shared_initial_noise`` one
    ``x_T`` per group, from the group's own generator."""
    slots, member, shared = [], {}, {}
    for prompt, meta, gid, pid in zip(prompts, metadata, groups.tolist(), prompt_ids.tolist()):
        m = member[gid] = member.get(gid, -1) + 1
        noise = None
        if shared_initial_noise:
            if gid not in shared:
                shared[gid] = policy.initial_noise(1, torch.Generator().manual_seed(derived_seed(seed, step, gid)))
            noise = shared[gid]
        g = torch.Generator().manual_seed(derived_seed(seed, step, gid, m, 5))
        slots.append(SampleSlot(prompt, meta, gid, pid, g, noise))
    return slots


def roll_out(policy: Any, batch: list[SampleSlot], how: Sampling, num_steps: int, guidance: float | None) -> Rollout:
    """One rollout batch (its slots' prefixes, where they have them, all of one length)."""
    noise = [s.initial_noise for s in batch]
    prefix = None if batch[0].prefix is None else torch.stack([s.prefix for s in batch])
    return rollout(policy, [s.prompt for s in batch], num_steps=num_steps, sampler=how.sampler,
                   noise_level=how.noise_level, guidance_scale=guidance, sde_window=how.sde_window,
                   metadata=[s.metadata for s in batch], generators=[s.generator for s in batch],
                   initial_noise=None if noise[0] is None else torch.cat(noise), cps_log_prob=how.cps_log_prob,
                   keep_velocities=how.keep_velocities, sde_last_step=how.sde_last_step,
                   keep_unconditional=how.keep_unconditional, prefix=prefix, grid=how.grid,
                   timestep_form=how.timestep_form, tail=how.tail)


def sample_and_score(policy: Any, rewards: RewardSet, batches: list[list[SampleSlot]], sampling: dict[int, Sampling],
                     num_steps: int, guidance: float | None,
                     while_scoring: Callable[[list[Rollout], Callable[[], bool]], Any] | None = None,
                     ) -> tuple[list[Rollout], RewardScores, dict[str, float], Any]:
    """Every batch rolled out in turn while a worker thread scores the previous ones.

    ``while_scoring(chunks, scored)`` (optional) runs on this thread once the last batch is drawn, while
    its rewards are still being scored; ``scored()`` turns True once every score is in.

    Returns the rollouts, their scores (rollout order), ``time/sample`` (until the last batch is drawn),
    ``time/prepare`` (in ``while_scoring``) and ``time/reward`` (waiting for the scores after that), and
    what ``while_scoring`` returned (None without one)."""
    t0 = time.perf_counter()
    chunks: list[Rollout] = []
    pending: list[Future] = []
    prepared = None
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="rewards") as pool:
        for batch in batches:
            chunk = roll_out(policy, batch, sampling[batch[0].group], num_steps, guidance)
            chunks.append(chunk)
            pending.append(pool.submit(rewards.score, chunk.samples, chunk.prompts, chunk.metadata))
        t_sample = time.perf_counter()
        if while_scoring is not None:
            prepared = while_scoring(chunks, lambda: all(f.done() for f in pending))
        t_prepared = time.perf_counter()
        scores = RewardScores.cat([f.result() for f in pending])
    times = {"time/sample": t_sample - t0, "time/prepare": t_prepared - t_sample,
             "time/reward": time.perf_counter() - t_prepared}
    return chunks, scores, times, prepared


def gathered_advantages(kind: str, scores: RewardScores, prompt_ids: torch.Tensor, acc: Any, clip: float,
                        **options: Any) -> torch.Tensor:
    """Advantages ``(N,)`` of this rank's samples from every rank's rewards, normalised per prompt;
    invalid samples get 0 (they take their prompt's valid mean, so they neither move nor receive the
    statistics). ``options`` go to :func:`flowalign.advantages.compute_advantages` (e.g. ``pairwise_weight``)."""
    comps, ok, pids = (acc.gather(t.to(acc.device)).cpu() for t in (scores.values, scores.valid, prompt_ids))
    parts = {scores.names.index(name): _filled(acc.gather(t.to(acc.device)).cpu(), ok, pids)
             for name, t in scores.parts.items()}
    adv = compute_advantages(kind, _filled(comps, ok, pids), scores.weights, pids, clip=clip, judged=scores.pairwise,
                             parts=parts, **options)
    adv[~ok] = 0.0
    n = len(scores)
    return adv[acc.process_index * n : (acc.process_index + 1) * n]


def _filled(values: torch.Tensor, ok: torch.Tensor, pids: torch.Tensor) -> torch.Tensor:
    """``values (N, K)`` with each invalid sample's row replaced by its prompt's valid mean (0 where the prompt
    has no valid sample: its advantages are zeroed, and a NaN would reach the whole batch's renormalisation)."""
    filled = values.clone()
    for p in torch.unique(pids):
        members = pids == p
        good = members & ok
        if good.any():
            filled[members & ~ok] = values[good].mean(0)
    return filled.nan_to_num(0.0)


def reward_logs(scores: RewardScores, acc: Any) -> dict[str, float]:
    """``reward/total`` over every rank's valid samples, per-reward means and the invalid fraction."""
    total, valid = (acc.gather(t.to(acc.device)).cpu() for t in (scores.total, scores.valid))
    return {
        "reward/total": total[valid].mean().item() if valid.any() else float("nan"),
        **scores.logs(),
        "reward/invalid_fraction": 1.0 - scores.valid.float().mean().item(),
    }


def check_invalid(scores: RewardScores, step: int, limit: float, samples: torch.Tensor | None = None,
                  run_dir: Path | None = None) -> None:
    """Refuse a batch with more than ``limit`` invalid rewards, naming the reason most of them share (the
    reward's own, e.g. a wrong frame count and its fix); non-finite ``samples`` (a diverged policy) are
    named as the cause first."""
    invalid = 1.0 - scores.valid.float().mean().item()
    if invalid > limit:
        if samples is not None and run_dir is not None:
            check_training_finite(step + 1, {}, {"sampled outputs": samples}, run_dir)  # diverged?
        reason, count = scores.commonest_reason() or ("no reason given", 0)
        raise UserError(f"step {step}: {invalid:.0%} of the samples have invalid rewards (limit "
                        f"run.max_invalid_fraction={limit}); the commonest reason ({count} of "
                        f"{int((~scores.valid).sum())}): {reason}")
