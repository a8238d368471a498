"""Chunk-by-chunk sampling of streaming (autoregressive) video policies: ``stream_rollout(policy, prompts, ...)``.

A :class:`flowalign.protocols.StreamingPolicy` generates a video as a sequence of chunks of latent frames:
chunk k is denoised over the σ grid while attending to the clean chunks before it through a KV cache, then
enters the cache. The rollout keeps what trainers of such models need: every chunk's trajectory, the cache
each chunk started from (the state a stream is forked at), and per-step log-probabilities on the chunks
sampled stochastically (NaN on ODE steps, as :class:`flowalign.sampling.rollout.Rollout` keeps them).

A policy whose own few-step sampler is stochastic (``own_sampler``, e.g. a causal Wan generator's x̂0 re-noised
with fresh noise: ``("cps", 1.0)``) takes that step on the chunks not sampled otherwise. Its fresh noise for
chunk k's step i is keyed by the stream's initial noise and ``(k, i)`` (:func:`keyed_draws`): a stream's draws
do not depend on the batch it is sampled in, forks from the same noise draw the same noise after the fork, and
a resumed run redraws what it drew.

Prompt switches (LongLive's interactive streams): ``switches=[(frame, prompts), ...]`` moves the streams to
new prompts from the first chunk starting at or after each latent frame, the cache recached under them by the
policy's ``switch_prompt``.

Forking: ``prefix=StreamPrefix(clean, cache)`` starts every stream at chunk ``cache.num_chunks`` with those
clean chunks and that cache (repeat a rollout's prefix ``n`` times with :meth:`StreamRollout.prefix` and
``repeats=n``), so forks share everything before the fork chunk bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Collection, Sequence

import hashlib

import torch

from flowalign.errors import UserError
from flowalign.protocols import Conditioning, StreamingPolicy
from flowalign.sampling.inputs import encode_prompts
from flowalign.sampling.rollout import check_prompts, check_sampler
from flowalign.sampling.steps import cps_moments, sde_step


@dataclass
class StreamPrefix:
    """The clean chunks ``0..k-1`` ``(B, C, F_{<k}, H, W)`` and the cache made from them (``cache.num_chunks == k``)."""

    clean: torch.Tensor
    cache: Any

    def repeat_interleave(self, repeats: int) -> "StreamPrefix":
        """Each stream's prefix ``repeats`` times in place (a group of forks)."""
        return StreamPrefix(self.clean.repeat_interleave(repeats, dim=0), self.cache.repeat_interleave(repeats))


@dataclass
class StreamRollout:
    """A batch of streamed videos.

    ``chunks[k]``: chunk k's trajectory ``(B, T+1, C, f_k, H, W)`` float32 (``[:, 0]`` its noise, ``[:, T]`` the
    clean chunk); chunks before ``start`` (a forked rollout's shared prefix) hold only their clean latents
    ``(B, 1, C, f_k, H, W)``. ``sigmas`` ``(T+1,)`` (every chunk's grid); ``log_probs`` ``(B, K, T)`` stored at
    sampling time, NaN on ODE steps and on prefix chunks; ``sde_chunks`` ``(K,)`` bool, the chunks sampled
    stochastically; ``caches[k]`` the cache chunk k started from (for ``k >= start``; None before);
    ``samples`` the decoded videos ``(B, F, 3, H, W)`` (None when not decoded); ``velocities[k]`` ``(B, T, C, f_k,
    H, W)`` the velocities chunk k's steps predicted where the policy's own stochastic step took them (None
    elsewhere: see :meth:`taken_velocities`); ``draw_keys`` the keys of each stream's own-sampler draws
    (:func:`keyed_draws`; None for a deterministic policy); ``switches`` the prompt switches taken, ``(chunk,
    prompts)`` each (``cond`` is then the first prompts'; None: one prompt a stream throughout).
    """

    prompts: list[str]
    metadata: list[dict[str, Any]]
    chunks: list[torch.Tensor]
    sigmas: torch.Tensor
    log_probs: torch.Tensor
    sde_chunks: torch.Tensor
    caches: list[Any]
    samples: torch.Tensor | None
    cond: Conditioning
    start: int = 0
    sampler: str = "ode"
    noise_level: float = 0.0
    guidance_scale: float = 1.0
    velocities: list[torch.Tensor | None] | None = None
    draw_keys: list[int] | None = None
    switches: list[tuple[int, list[str]]] | None = None

    def __len__(self) -> int:
        return self.chunks[0].shape[0]

    @property
    def num_chunks(self) -> int:
        return len(self.chunks)

    @property
    def final_latents(self) -> torch.Tensor:
        """The clean video latents ``(B, C, F, H, W)``."""
        return torch.cat([c[:, -1] for c in self.chunks], dim=2)

    def prefix(self, k: int, rows: Sequence[int] | None = None) -> StreamPrefix:
        """The state chunk ``k`` started from (of the streams ``rows``, default all): the clean chunks before it
        and its cache."""
        if not self.start <= k < self.num_chunks:
            raise UserError(f"prefix: chunk {k} was not sampled by this rollout (chunks {self.start}..{self.num_chunks - 1})")
        if self.caches[k] is None:
            raise UserError(f"prefix: the rollout did not keep chunk {k}'s cache (stream_rollout's keep_caches)")
        clean = self.final_latents[:, :, :sum(c.shape[3] for c in self.chunks[:k])]
        if rows is None:
            return StreamPrefix(clean, self.caches[k])
        return StreamPrefix(clean[list(rows)], self.caches[k].select(list(rows)))

    def step(self, k: int, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(x_i, x_{i+1}, stored log_prob)`` of chunk ``k``'s step ``i``: ``(B, C, f_k, H, W)`` twice and ``(B,)``."""
        return self.chunks[k][:, i], self.chunks[k][:, i + 1], self.log_probs[:, k, i]

    def taken_velocities(self, k: int) -> torch.Tensor:
        """``(B, T, C, f_k, H, W)``: the velocity each step of chunk ``k`` followed, so that ``x_t − σ_t·u_t`` is
        the clean prediction the step took: the stored prediction where the policy's own step re-noised it,
        else the jump ``(x_{t+1} − x_t)/(σ_{t+1} − σ_t)`` (:func:`jump_velocities`; deterministic steps)."""
        stored = self.velocities[k] if self.velocities is not None and k < len(self.velocities) else None
        return stored if stored is not None else jump_velocities(self.chunks[k], self.sigmas)


@torch.no_grad()
def stream_rollout(
    policy: StreamingPolicy,
    prompts: Sequence[str],
    *,
    num_steps: int,
    sampler: str = "ode",
    noise_level: float | None = None,
    sde_chunks: Sequence[int] | None = None,
    guidance_scale: float | None = None,
    generator: torch.Generator | None = None,
    initial_noise: torch.Tensor | None = None,
    metadata: Sequence[dict[str, Any]] | None = None,
    prefix: StreamPrefix | None = None,
    route: Callable[[int], Sequence[int]] | None = None,
    decode: bool = True,
    draw_keys: Sequence[int] | None = None,
    switches: Sequence[tuple[int, Sequence[str]]] | None = None,
    keep_caches: Collection[int] | None = None,
) -> StreamRollout:
    """Stream ``len(prompts)`` videos chunk by chunk, ``num_steps`` steps per chunk on the policy's σ grid.

    ``sampler`` (a kind of :func:`flowalign.sampling.steps.sde_step`) samples the chunks ``sde_chunks``
    (default: every chunk when the sampler is stochastic) stochastically, storing their log-probs; the other
    chunks take the policy's deterministic steps. ``initial_noise`` ``(B, C, F, H, W)``: the whole video's
    noise (chunk k denoises its slice of it), drawn by ``policy.initial_noise`` from ``generator`` when None.
    ``prefix``: start at chunk ``prefix.cache.num_chunks`` from those clean chunks and that cache (a fork).
    ``draw_keys``: one key per stream for the policy's own stochastic steps (default: a digest of each stream's
    initial noise, :func:`stream_keys`); candidates given their centre stream's key share its solver noise.
    ``route``: KV routing, ``route(k)`` the history chunks chunk ``k`` attends to (every earlier chunk when it
    returns them all; the default), through the policy's ``reroute`` of the cache the stream wrote where it has
    one (a causal model writes each chunk's entries once, under the routing then in force), else its
    ``history_cache``; a prefix's cache is used as given. ``switches``: ``(frame, prompts)`` pairs, frames
    increasing: from the first chunk starting at or after latent frame ``frame`` the streams follow ``prompts``
    (one a stream), the cache first recached under them by the policy's ``switch_prompt`` (LongLive's
    ``switch_frame_indices``; a switch before a prefix's first chunk only sets the prompts). ``keep_caches``: the
    chunks whose starting cache the rollout keeps (default all; a long stream on a resident cache keeps only the
    caches it will fork from, or its memory holds every frame's entries).
    """
    prompts = check_prompts(prompts)
    level = check_sampler(sampler, noise_level)
    if num_steps < 1:
        raise UserError(f"num_steps must be >= 1, got {num_steps}")
    guidance = float(policy.defaults.get("guidance_scale", 1.0) if guidance_scale is None else guidance_scale)
    meta = [dict(m) for m in metadata] if metadata is not None else [{} for _ in prompts]
    n, chunks = len(prompts), len(policy.chunk_frames)
    stochastic = torch.zeros(chunks, dtype=torch.bool)
    if sampler != "ode":
        picked = range(chunks) if sde_chunks is None else list(sde_chunks)
        bad = [k for k in picked if not 0 <= k < chunks]
        if bad:
            raise UserError(f"sde_chunks {bad} are out of range: this model streams {chunks} chunks (0..{chunks - 1})")
        stochastic[list(picked)] = True

    cond = encode_prompts(policy, prompts, meta)
    switch_at = switch_chunks(policy, switches, n)
    sigmas = policy.sigmas(num_steps).float()
    noise = policy.initial_noise(n, generator) if initial_noise is None else initial_noise.float()
    noise = noise.to(policy.device)
    if prefix is None:
        start, cache, clean = 0, policy.empty_cache(n, guidance), noise[:, :, :0]
    else:
        start, cache, clean = prefix.cache.num_chunks, prefix.cache, prefix.clean.to(policy.device).float()
        if prefix.cache.batch != n or clean.shape[0] != n:
            raise UserError(f"prefix holds {prefix.cache.batch} streams for {n} prompts: repeat it with "
                            "StreamPrefix.repeat_interleave to fork each stream")
    own_kind, own_level = getattr(policy, "own_sampler", ("ode", 0.0))
    keys: list[int] = []
    if own_kind != "ode":
        keys = stream_keys(noise) if draw_keys is None else [int(k) for k in draw_keys]
        if len(keys) != n:
            raise UserError(f"draw_keys holds {len(keys)} keys for {n} streams: give one a stream")
    trajectories = [clean[:, None, :, policy.chunk_slice(k)] for k in range(start)]
    caches: list[Any] = [None] * start
    velocities: list[torch.Tensor | None] = [None] * start
    log_probs = torch.full((n, chunks, num_steps), float("nan"))
    # each streamed chunk's log-probs (B, num_steps), kept on the device and read back once after the last
    # chunk: a read at every step would make the host wait for the device there
    streamed: list[torch.Tensor] = []
    for k, new in switch_at.items():  # switches before a prefix's first chunk: its cache holds them already
        if k <= start:
            cond = encode_prompts(policy, new, meta)
    for k in range(start, chunks):
        if k in switch_at and k > start:
            cond = encode_prompts(policy, switch_at[k], meta)
            cache = policy.switch_prompt(cache, clean, cond, guidance)
        caches.append(cache if keep_caches is None or k in keep_caches else None)
        x = noise[:, :, policy.chunk_slice(k)]
        kind, kind_level = (sampler, level) if stochastic[k] else (own_kind, own_level)
        path, steps, taken = [x], [], []
        for i in range(num_steps):
            s, s_next = sigmas[i].item(), sigmas[i + 1].item()
            v = policy.chunk_velocity(x, s, s_next, cache, cond, guidance)
            draw = None
            if not stochastic[k] and own_kind != "ode":
                taken.append(v.float())
                if s_next > 0:
                    draw = own_step(own_kind, own_level, v, x, s, s_next, keyed_draws(keys, k, i, x))
            out = sde_step(kind, v, x, s, s_next, noise_level=kind_level, generator=generator, prev_sample=draw)
            x = out.prev_sample
            path.append(x)
            steps.append(out.log_prob.float())
        streamed.append(torch.stack(steps, dim=1))
        trajectories.append(torch.stack(path, dim=1))
        velocities.append(torch.stack(taken, dim=1) if taken else None)
        clean = torch.cat([clean, x], dim=2)
        if k < chunks - 1:
            if route is None:
                cache = policy.append_chunks(cache, clean, cond, guidance)
            elif hasattr(policy, "reroute"):  # a cache written once: the new chunk joins it, then reads are routed
                cache = policy.reroute(policy.append_chunks(cache, clean, cond, guidance), route(k + 1))
            else:  # a cache re-encoded from the chunks it holds
                cache = policy.history_cache(clean, route(k + 1), cond, guidance)
    if streamed:
        log_probs[:, start:] = torch.stack(streamed, dim=1).cpu()
    result = StreamRollout(prompts=prompts, metadata=meta, chunks=trajectories, sigmas=sigmas.cpu(), log_probs=log_probs,
                           sde_chunks=stochastic, caches=caches, samples=None, cond=cond, start=start, sampler=sampler,
                           noise_level=level, guidance_scale=guidance, velocities=velocities,
                           draw_keys=keys or None, switches=[(k, list(p)) for k, p in switch_at.items()] or None)
    if decode:
        result.samples = policy.decode(result.final_latents)
    return result


def switch_chunks(policy: StreamingPolicy, switches: Sequence[tuple[int, Sequence[str]]] | None,
                  streams: int) -> dict[int, list[str]]:
    """The chunk each prompt switch takes effect at (the first starting at or after its latent frame) → the
    prompts from there on; each switch its own chunk, after chunk 0 (a switch at frame 0 is the first prompt)."""
    if not switches:
        return {}
    if not hasattr(policy, "switch_prompt"):
        raise UserError(f"prompt switches: {policy.family} streams one prompt a video (no recache under a new "
                        "prompt); switch prompts on a causal Wan (LongLive, Self-Forcing)")
    starts = [policy.chunk_slice(k).start for k in range(len(policy.chunk_frames))]
    taken: dict[int, list[str]] = {}
    for frame, new in switches:
        new = check_prompts(list(new))
        later = [k for k, first in enumerate(starts) if first >= int(frame)]
        if int(frame) < 1 or not later:
            raise UserError(f"prompt switch at latent frame {frame}: it must fall in 1..{starts[-1]} (this model "
                            f"streams {sum(policy.chunk_frames)} latent frames, chunks starting at {starts})")
        k = later[0]
        if taken and k <= max(taken):
            raise UserError(f"prompt switch at latent frame {frame}: switches must move to later chunks, each its "
                            f"own (chunks start at {starts})")
        if len(new) != streams:
            raise UserError(f"prompt switch at latent frame {frame}: {len(new)} prompts for {streams} streams")
        taken[k] = new
    return taken


def switched_history(policy: StreamingPolicy, clean: torch.Tensor, segments: Sequence[tuple[int, Conditioning]],
                     guidance: float) -> Any:
    """The cache the next chunk reads after the clean chunks of ``clean`` ``(B, C, F_{<k}, H, W)`` of a stream
    that switched prompts: ``segments`` ``(first chunk, conditioning)`` in order, the first at chunk 0; each
    chunk written under its segment's prompt and the cache recached (``switch_prompt``) where a segment starts,
    as :func:`stream_rollout` with ``switches`` wrote it (a segment starting at chunk k recaches before it)."""
    k = next(j for j in range(len(policy.chunk_frames) + 1) if sum(policy.chunk_frames[:j]) == clean.shape[2])
    cache = policy.empty_cache(clean.shape[0], guidance)
    for (first, cond), (end, _) in zip(segments, [*segments[1:], (k + 1, None)]):
        if first > k:
            break
        if first > 0:
            cache = policy.switch_prompt(cache, clean[:, :, :policy.chunk_slice(first).start], cond, guidance)
        last = min(end, k) - 1
        if last >= first:
            cache = policy.append_chunks(cache, clean[:, :, :policy.chunk_slice(last).stop], cond, guidance)
    return cache


def jump_velocities(states: torch.Tensor, sigmas: torch.Tensor) -> torch.Tensor:
    """``u_t = (x_{t+1} − x_t)/(σ_{t+1} − σ_t)`` ``(G, T, ...)`` of deterministic trajectories ``states (G, T+1, ...)``."""
    steps = (sigmas[1:] - sigmas[:-1]).to(states, non_blocking=True).view(1, -1, *[1] * (states.ndim - 2))
    return (states[:, 1:] - states[:, :-1]) / steps


def stream_keys(noise: torch.Tensor) -> list[int]:
    """One 63-bit key per stream: a digest of its whole-video initial noise ``(B, C, F, H, W)`` (read once)."""
    rows = noise.detach().float().cpu().contiguous()
    return [int.from_bytes(hashlib.sha256(row.numpy().tobytes()).digest()[:8], "little") >> 1 for row in rows]


def keyed_draws(keys: list[int], k: int, i: int, like: torch.Tensor) -> torch.Tensor:
    """Standard normal noise shaped as ``like`` ``(B, ...)`` for chunk ``k``'s step ``i``, each row from its own
    generator seeded by the stream's key and ``(k, i)``, on ``like``'s device, float32."""
    rows = [torch.randn(like.shape[1:], generator=torch.Generator().manual_seed((key + 1_000_003 * (k * 1_000 + i))
                                                                                % (2**63 - 1)))
            for key in keys]
    return torch.stack(rows).to(like.device, non_blocking=True)


def own_step(kind: str, level: float, v: torch.Tensor, x: torch.Tensor, sigma: float, sigma_next: float,
             noise: torch.Tensor) -> torch.Tensor:
    """The next state of a policy's own stochastic step with the given standard normal ``noise``: the step's
    mean plus its std times the noise (CPS: :func:`flowalign.sampling.steps.cps_moments`)."""
    if kind != "cps":
        raise UserError(f"own_sampler {kind!r}: a streaming policy's own stochastic step must be CPS")
    mean, std = cps_moments(v, x, sigma, sigma_next, eta=level)
    return mean + std * noise
