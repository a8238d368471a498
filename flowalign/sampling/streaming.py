"""Chunk-by-chunk sampling of streaming (autoregressive) video policies: ``stream_rollout(policy, prompts, ...)``.

A :class:`flowalign.protocols.StreamingPolicy` generates a video as a sequence of chunks of latent frames:
chunk k is denoised over the σ grid while attending to the clean chunks before it through a KV cache, then
enters the cache. The rollout keeps what trainers of such models need: every chunk's trajectory, the cache
each chunk started from (the state a stream is forked at), and per-step log-probabilities on the chunks
sampled stochastically (NaN on ODE steps, as :class:`flowalign.sampling.rollout.Rollout` keeps them).

Forking: ``prefix=StreamPrefix(clean, cache)`` starts every stream at chunk ``cache.num_chunks`` with those
clean chunks and that cache (repeat a rollout's prefix ``n`` times with :meth:`StreamRollout.prefix` and
``repeats=n``), so forks share everything before the fork chunk bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from flowalign.errors import UserError
from flowalign.protocols import Conditioning, StreamingPolicy
from flowalign.sampling.inputs import encode_prompts
from flowalign.sampling.rollout import check_prompts, check_sampler
from flowalign.sampling.steps import sde_step


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
    ``samples`` the decoded videos ``(B, F, 3, H, W)`` (None when not decoded).
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
        clean = self.final_latents[:, :, :sum(c.shape[3] for c in self.chunks[:k])]
        if rows is None:
            return StreamPrefix(clean, self.caches[k])
        return StreamPrefix(clean[list(rows)], self.caches[k].select(list(rows)))

    def step(self, k: int, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(x_i, x_{i+1}, stored log_prob)`` of chunk ``k``'s step ``i``: ``(B, C, f_k, H, W)`` twice and ``(B,)``."""
        return self.chunks[k][:, i], self.chunks[k][:, i + 1], self.log_probs[:, k, i]


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
) -> StreamRollout:
    """Stream ``len(prompts)`` videos chunk by chunk, ``num_steps`` steps per chunk on the policy's σ grid.

    ``sampler`` (a kind of :func:`flowalign.sampling.steps.sde_step`) samples the chunks ``sde_chunks``
    (default: every chunk when the sampler is stochastic) stochastically, storing their log-probs; the other
    chunks take the policy's deterministic steps. ``initial_noise`` ``(B, C, F, H, W)``: the whole video's
    noise (chunk k denoises its slice of it), drawn by ``policy.initial_noise`` from ``generator`` when None.
    ``prefix``: start at chunk ``prefix.cache.num_chunks`` from those clean chunks and that cache (a fork).
    ``route``: KV routing, ``route(k)`` the history chunks chunk ``k`` attends to (every earlier chunk when it
    returns them all; the default), through the policy's ``history_cache``; a prefix's cache is used as given.
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
    trajectories = [clean[:, None, :, policy.chunk_slice(k)] for k in range(start)]
    caches: list[Any] = [None] * start
    log_probs = torch.full((n, chunks, num_steps), float("nan"))
    # each streamed chunk's log-probs (B, num_steps), kept on the device and read back once after the last
    # chunk: a read at every step would make the host wait for the device there
    streamed: list[torch.Tensor] = []
    for k in range(start, chunks):
        caches.append(cache)
        x = noise[:, :, policy.chunk_slice(k)]
        kind = sampler if stochastic[k] else "ode"
        path, steps = [x], []
        for i in range(num_steps):
            s, s_next = sigmas[i].item(), sigmas[i + 1].item()
            v = policy.chunk_velocity(x, s, s_next, cache, cond, guidance)
            out = sde_step(kind, v, x, s, s_next, noise_level=level if kind != "ode" else 0.0, generator=generator)
            x = out.prev_sample
            path.append(x)
            steps.append(out.log_prob.float())
        streamed.append(torch.stack(steps, dim=1))
        trajectories.append(torch.stack(path, dim=1))
        clean = torch.cat([clean, x], dim=2)
        if k < chunks - 1:
            cache = (policy.append_chunks(cache, clean, cond, guidance) if route is None
                     else policy.history_cache(clean, route(k + 1), cond, guidance))
    if streamed:
        log_probs[:, start:] = torch.stack(streamed, dim=1).cpu()
    result = StreamRollout(prompts=prompts, metadata=meta, chunks=trajectories, sigmas=sigmas.cpu(), log_probs=log_probs,
                           sde_chunks=stochastic, caches=caches, samples=None, cond=cond, start=start, sampler=sampler,
                           noise_level=level, guidance_scale=guidance)
    if decode:
        result.samples = policy.decode(result.final_latents)
    return result
