"""Causal Wan 2.1 streaming text-to-video (Self-Forcing, LongLive, Causal-Forcing) as a
:class:`flowalign.protocols.StreamingPolicy`.

These checkpoints are Wan 2.1-T2V-1.3B's transformer, trained to generate a video block by block: each block of
``chunk_frames`` latent frames (3 in every release) attends to itself and, through a KV cache, to the clean
blocks before it. The folder is a diffusers ``WanPipeline`` folder (UMT5, ``AutoencoderKLWan``, the causal
generator as ``WanTransformer3DModel``) whose ``model_index.json`` carries ``"_flowalign_streaming":
"causal_wan"`` (what ``flowalign causal-wan`` writes from the authors' checkpoint; a plain Wan folder stays a
bidirectional :class:`pipelines.wan_t2v.WanPolicy`). The authors' inference (``CausalInferencePipeline``, the
same in Self-Forcing and LongLive) streams a video as:

* Chunk k is denoised from its slice of the whole video's noise over their few-step grid (``sigmas``): at each
  step the transformer's flow prediction gives ``x̂0 = x − σ·v``, and the next state is ``x̂0`` re-noised with
  fresh noise, ``(1 − σ')·x̂0 + σ'·ε``; the last step's ``x̂0`` is the chunk. That is CPS at η = 1
  (:func:`flowalign.sampling.steps.cps_step`), the policy's ``own_sampler``.
* The clean chunk is then run once more at timestep 0 (their ``context_noise``) and its keys and values join the
  cache: a chunk's cache entries are computed attending to the cache before it, as theirs.
* RoPE positions are absolute frame indices (a chunk starting at frame s rotates its queries and keys as frames
  s, s+1, ...; cached keys keep the rotation they were written with).
* LongLive's local attention: with ``attention_window`` W frames and ``sink_frames`` S, a chunk attends to the
  first S frames held and to the last W − S frames of (history + itself), as their rolling cache with a frame
  sink gives. ``attention_window: null`` (Self-Forcing, Causal-Forcing) attends to every frame held.
* No CFG: the released generators are distilled with guidance inside (``guidance_scale`` must be 1).
* LongLive's interactive streams switch prompts between chunks (:meth:`CausalWanPolicy.switch_prompt`, their
  ``_recache_after_switch``): the recent frames are run again under the new prompt and their entries replace
  the old ones, the sink kept (``global_sink``, theirs) or restarted.

The cache is a value (:class:`CausalKVCache`): appending a chunk returns a new one, so forks stay independent.
The FlowPolicy half (``velocity`` over a whole video) is the block-causal training path: every chunk at the same
σ attending to itself and the earlier chunks' tokens under the same window, computed chunk by chunk.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from diffusers import AutoencoderKLWan, WanPipeline
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.transformers.transformer_wan import _get_qkv_projections

from flowalign.errors import UserError
from flowalign.protocols import Conditioning, KeptFrames
from pipelines import lora as lora_utils
from pipelines._common import SAMPLING_KEYS, ATTENTION_LORA_TARGETS, PromptCache, batch_size, check_multiple
from pipelines._common import check_num_steps, check_prompts, chunk_slice, decode_in_chunks
from pipelines._common import encode_with_empty_negative
from pipelines._common import gaussian_noise, make_trainable, merge_defaults, open_pipeline, sigma_batch
from pipelines._common import text_encoders, vae_latent_stats

#: the model_index.json key and value that mark a Wan folder as a causal streaming generator
MARKER_KEY, MARKER = "_flowalign_streaming", "causal_wan"
DEFAULT_LORA_TARGETS = ATTENTION_LORA_TARGETS


def is_causal_wan(index: dict[str, Any]) -> bool:
    """Whether a ``model_index.json`` marks its Wan folder as a causal streaming generator."""
    return index.get(MARKER_KEY) == MARKER


@dataclass
class StreamCall:
    """What every self-attention of one transformer call reads, handed to them in place of the rotary
    embedding (the transformer passes ``rotary_emb`` through to each block, under gradient checkpointing too).

    ``cos``, ``sin``: ``(1, tokens, 1, head_dim)`` RoPE of this call's frames at their absolute positions;
    ``past``: indexed by block, the keys and values ``(B, T, heads, head_dim)`` attended before this call's own
    tokens (a :class:`CacheWindow`; None: none); ``written``: filled per block with this call's own rotated keys
    and values (what a cache keeps) from its token ``write_from`` on; ``own_from``: the first of its own tokens
    attended (a prompt switch's recache reads and writes the frames LongLive's cache slots give it).
    """

    cos: torch.Tensor
    sin: torch.Tensor
    past: Any = None
    written: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None
    own_from: int = 0
    write_from: int = 0


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Wan's RoPE on ``(B, S, heads, D)`` (interleaved pairs), as diffusers' Wan attention applies it."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    c, s = cos[..., 0::2], sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * c - x2 * s
    out[..., 1::2] = x1 * s + x2 * c
    return out.type_as(x)


class StreamingSelfAttention:
    """Block ``index``'s self-attention over the cached keys and values and its own tokens
    (:class:`StreamCall`); diffusers' ``WanAttnProcessor`` otherwise."""

    def __init__(self, index: int) -> None:
        self.index = index

    def __call__(self, attn: Any, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, rotary_emb: Any = None) -> torch.Tensor:
        if not isinstance(rotary_emb, StreamCall):
            raise RuntimeError("a causal Wan transformer is called through its policy (CausalWanPolicy), which "
                               "hands every block the stream's positions and cache")
        query, key, value = _get_qkv_projections(attn, hidden_states, None)
        query, key = attn.norm_q(query), attn.norm_k(key)
        query, key, value = (t.unflatten(2, (attn.heads, -1)) for t in (query, key, value))
        query, key = rotate(query, rotary_emb.cos, rotary_emb.sin), rotate(key, rotary_emb.cos, rotary_emb.sin)
        if rotary_emb.written is not None:
            rotary_emb.written[self.index] = (key[:, rotary_emb.write_from:], value[:, rotary_emb.write_from:])
        if rotary_emb.own_from:
            key, value = key[:, rotary_emb.own_from:], value[:, rotary_emb.own_from:]
        if rotary_emb.past is not None:
            past_key, past_value = rotary_emb.past[self.index]
            key, value = torch.cat([past_key.to(key.dtype), key], 1), torch.cat([past_value.to(value.dtype), value], 1)
        out = dispatch_attention_fn(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False)
        out = out.flatten(2, 3).type_as(query)
        return attn.to_out[1](attn.to_out[0](out))


def hand_over_call(rope: torch.nn.Module, hidden_states: torch.Tensor) -> StreamCall:
    """The rope module's forward while streaming: the :class:`StreamCall` its policy set for this call."""
    call = rope.__dict__.pop("stream_call", None)
    if call is None:
        raise RuntimeError("a causal Wan transformer is called through CausalWanPolicy's methods, which set the "
                           "stream's positions and cache")
    return call


def attended_frames(held: int, new: int, window: int | None, sink: int) -> list[tuple[int, int]]:
    """The frame ranges of the ``held`` cached frames that ``new`` frames attend to (besides themselves): all of
    them, or with a ``window`` of W frames the first ``sink`` frames and the last W − sink frames of
    (held + new), as LongLive's rolling cache with a frame sink keeps them."""
    if window is None or held + new <= window:
        return [(0, held)]
    head = min(sink, held)
    tail = max(head, held + new - (window - sink))
    return [(0, head), (tail, held)] if tail < held else [(0, head)]


@dataclass(frozen=True)
class CacheSegment:
    """Keys and values written by one transformer call: frames ``first..first+frames-1``, per block ``(k, v)``
    each ``(B, frames·tokens, heads, head_dim)`` (frame by frame)."""

    first: int
    frames: int
    blocks: list[tuple[torch.Tensor, torch.Tensor]]


@dataclass
class CausalKVCache:
    """The resident cache of a batch of streams: the segments the calls wrote in order (a clean chunk's, or a
    prompt switch's recache of recent frames, :meth:`CausalWanPolicy.switch_prompt`; a frame's entries are
    those of the latest segment holding it), the stream chunks written (``num_chunks``) and the absolute frames
    the next chunk reads (``kept``, sorted: every written frame unless the history is routed,
    :meth:`CausalWanPolicy.reroute`, or a switch restarted the sink). Entries are written once and shared by
    every later cache of the stream (appending a chunk copies nothing); routing only changes what is read, as
    LongLive's perturbed window reads chosen frames of its resident cache."""

    segments: tuple[CacheSegment, ...]
    batch: int
    num_chunks: int
    kept: tuple[int, ...]
    #: frames a routing holds on to past the resident window (their perturbed window's fixed memory tokens)
    pinned: frozenset[int] = frozenset()
    #: the frames written so far (``0..held-1``; a resident cache may hold fewer of them)
    held: int = 0
    #: the first frame of the sink (0; a switch that empties the cache restarts the sink at its recached frames)
    sink_first: int = 0

    @property
    def frames(self) -> int:
        """How many frames the next chunk may read (the kept ones)."""
        return len(self.kept)

    def latest(self) -> dict[int, tuple[int, int]]:
        """Each frame the cache holds → (the latest segment holding it, its frame in that segment)."""
        out: dict[int, tuple[int, int]] = {}
        for i, seg in enumerate(self.segments):
            out.update({seg.first + f: (i, f) for f in range(seg.frames)})
        return out

    def alive(self) -> set[int]:
        """The frames whose entries the cache still holds."""
        return set(self.latest())

    def resident(self, keep: set[int]) -> "CausalKVCache":
        """The cache holding only the frames ``keep`` (LongLive's rolling cache evicting the others): segments
        none of whose latest frames are kept are dropped, and the frames read are the kept ones among them."""
        latest = self.latest()
        used = {latest[f][0] for f in keep if f in latest}
        return dataclasses.replace(self, segments=tuple(seg for i, seg in enumerate(self.segments) if i in used),
                                   kept=tuple(f for f in self.kept if f in keep and f in latest),
                                   pinned=frozenset(f for f in self.pinned if f in keep))

    def select(self, index: list[int] | torch.Tensor) -> "CausalKVCache":
        """The caches of some streams, in the given order (repeat an index to fork a stream)."""
        idx = torch.as_tensor(index, dtype=torch.long).flatten()
        on: dict[torch.device, torch.Tensor] = {}
        pick = lambda t: t.index_select(0, on.setdefault(t.device, idx.to(t.device, non_blocking=True)))  # noqa: E731
        segments = tuple(dataclasses.replace(seg, blocks=[(pick(k), pick(v)) for k, v in seg.blocks])
                         for seg in self.segments)
        return dataclasses.replace(self, segments=segments, batch=len(idx))

    def repeat_interleave(self, repeats: int) -> "CausalKVCache":
        """Each stream's cache ``repeats`` times in place: a group of forks sharing one history."""
        return self.select([i for i in range(self.batch) for _ in range(repeats)])

    def pieces(self, frames: Sequence[int], tokens: int) -> "CacheWindow | None":
        """The entries of ``frames`` (in the given order; ``tokens`` a frame), as runs of consecutive frames of one
        segment; None when that is nothing."""
        latest = self.latest()
        pieces: list[tuple[int, int, int]] = []  # (segment, first token, end token)
        for frame in frames:
            i, f = latest[frame]
            lo = f * tokens
            if pieces and pieces[-1][0] == i and pieces[-1][2] == lo:
                pieces[-1] = (i, pieces[-1][1], lo + tokens)
            else:
                pieces.append((i, lo, lo + tokens))
        return CacheWindow(self.segments, pieces) if pieces else None

    def window(self, new: int, window: int | None, sink: int, tokens: int) -> "CacheWindow | None":
        """What ``new`` frames attend to before themselves (``tokens`` a frame): of the kept frames in stream
        order, those the window holds (:func:`attended_frames`)."""
        ranges = attended_frames(self.frames, new, window, sink)
        return self.pieces([f for a, b in ranges for f in self.kept[a:b]], tokens)


@dataclass
class CacheWindow:
    """A block's keys and values ``(B, T, heads, head_dim)`` of a window of a :class:`CausalKVCache`, joined when
    the block asks (one block's join is alive at a time)."""

    segments: tuple[CacheSegment, ...]
    pieces: list[tuple[int, int, int]]

    def __getitem__(self, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        keys = [self.segments[i].blocks[block][0][:, a:b] for i, a, b in self.pieces]
        values = [self.segments[i].blocks[block][1][:, a:b] for i, a, b in self.pieces]
        return (keys[0], values[0]) if len(keys) == 1 else (torch.cat(keys, 1), torch.cat(values, 1))


class CausalWanPolicy(lora_utils.AdapterMethods):
    """Causal Wan 2.1 streaming policy (see the module docstring and :class:`flowalign.protocols.StreamingPolicy`).

    ``Conditioning.tensors``: ``prompt_embeds (B, L, D)`` (UMT5)."""

    family = "wan"
    #: the model.defaults keys it reads
    sampling_keys: frozenset[str] = SAMPLING_KEYS | {"chunk_frames", "attention_window", "sink_frames", "global_sink",
                                                     "cache_frames"}
    is_video = True
    streaming = True
    #: its history can be routed frame by frame (:class:`flowalign.protocols.KeptFrames`)
    routes_frames = True
    #: the step its chunks take when not sampled otherwise: x̂0 re-noised with fresh noise (CPS at η = 1)
    own_sampler = ("cps", 1.0)

    @staticmethod
    def chunk_frames_of(config: Any, size: dict[str, Any]) -> int:
        """Latent frames of a chunk at ``size`` (``flowalign plan``: a streaming trainer's training forward)."""
        return int(size.get("chunk_frames") or 3)

    @staticmethod
    def kv_cache_bytes(config: Any, size: dict[str, Any], dtype_bytes: int) -> float:
        """Bytes of the caches one streamed sample keeps (``flowalign plan``): every chunk but the last writes
        its keys and values once, shared by the stream's later caches (:class:`CausalKVCache`), of which a
        resident cache (``cache_frames``, by default LongLive's attention window) holds at most its frames, the
        streams keeping only the caches they fork from (``stream_rollout``'s ``keep_caches``; a routing's held
        frames come from within it)."""
        f_t, f_s = int(size.get("vae_scale_temporal") or 4), int(size.get("vae_scale_spatial") or 8)
        frames = (int(size["num_frames"]) - 1) // f_t + 1
        _, ph, pw = config.patch_size
        tokens = (int(size["height"]) // f_s // ph) * (int(size["width"]) // f_s // pw)
        written = frames - int(size.get("chunk_frames") or 3)
        resident = size.get("cache_frames") or size.get("attention_window")
        held = written if resident is None else min(written, int(resident))
        return float(held * tokens * config.num_layers * 2 * config.num_attention_heads * config.attention_head_dim
                     * dtype_bytes)

    def __init__(self, path: str | Path, **options: Any) -> None:
        """``options``: :class:`pipelines._common.PolicyOptions`; ``decode_batch_size`` defaults to 2 videos."""
        opts = open_pipeline(self, WanPipeline, path, options, float32_vae=AutoencoderKLWan, decode_batch_size=2)
        self.scale_t, self.scale_s = self.pipe.vae_scale_factor_temporal, self.pipe.vae_scale_factor_spatial
        # the authors' inference configs: 4 steps (timesteps 1000, 750, 500, 250, warped at shift 5), blocks of
        # 3 latent frames, no CFG; 21 latent frames (81 at 480 x 832); LongLive: window 12 with a 3-frame sink
        builtin = {"height": 480, "width": 832, "num_frames": 81, "num_steps": 4, "guidance_scale": 1.0,
                   "max_sequence_length": 512, "shift": 5.0, "chunk_frames": 3, "attention_window": None,
                   "sink_frames": 0, "global_sink": True, "cache_frames": None}
        self.defaults: dict[str, Any] = merge_defaults(builtin, path, opts.defaults)
        _, ph, pw = self.transformer.config.patch_size
        check_multiple(self.defaults, {"height": self.scale_s * ph, "width": self.scale_s * pw}, "this Wan model")
        if (int(self.defaults["num_frames"]) - 1) % self.scale_t:
            raise UserError(f"num_frames={self.defaults['num_frames']}: num_frames - 1 must be a multiple of "
                            f"{self.scale_t} (the VAE's temporal factor)")
        if float(self.defaults["guidance_scale"]) != 1.0:
            raise UserError(f"model.defaults.guidance_scale={self.defaults['guidance_scale']}: a causal Wan "
                            "generator is distilled with its guidance inside; set it to 1")
        per, frames = int(self.defaults["chunk_frames"]), self.latent_shape[1]
        if per < 1 or frames % per:
            raise UserError(f"model.defaults.chunk_frames={per}: it must divide the {frames} latent frames of "
                            f"num_frames={self.defaults['num_frames']} (their releases: 3 frames a chunk, 21 frames)")
        self.chunk_frames: list[int] = [per] * (frames // per)
        self.window = None if self.defaults["attention_window"] is None else int(self.defaults["attention_window"])
        self.sink = int(self.defaults["sink_frames"])
        self.global_sink = bool(self.defaults["global_sink"])
        if self.window is not None and self.window < self.sink + per:
            raise UserError(f"model.defaults.attention_window={self.window}: it must hold the sink "
                            f"({self.sink} frames) and a chunk ({per}); LongLive's is 12 with sink_frames 3")
        # their cache: the attention window's frames at inference (every frame with global attention)
        self.cache_frames = self.window if self.defaults["cache_frames"] is None else int(self.defaults["cache_frames"])
        if self.cache_frames is not None and self.cache_frames < max(self.window or frames, self.sink + per):
            raise UserError(f"model.defaults.cache_frames={self.cache_frames}: the resident cache must hold the "
                            f"attention window ({self.window or frames} frames) and the sink and a chunk; LongLive's "
                            "is 12 at inference, 33 in KVPO's training")
        self.tokens_per_frame = (self.latent_shape[2] // ph) * (self.latent_shape[3] // pw)
        self.trainable: torch.nn.Module = make_trainable(self.transformer, opts, DEFAULT_LORA_TARGETS)
        for index, block in enumerate(self.transformer.blocks):
            block.attn1.set_processor(StreamingSelfAttention(index))
        self._rope = self.transformer.rope
        # the transformer's rotary embedding becomes the StreamCall set on it just before the call (bound to the
        # rope module, so a deep copy of the transformer stays self-contained)
        self._rope.forward = types.MethodType(hand_over_call, self._rope)
        self._cache = PromptCache(opts.prompt_cache_size, text_encoders(self.pipe))

    # ------------------------------------------------------------------ shapes and text

    @property
    def latent_shape(self) -> tuple[int, int, int, int]:
        """``(C, F', H', W')`` of one video at the default size."""
        return (self.transformer.config.in_channels, (int(self.defaults["num_frames"]) - 1) // self.scale_t + 1,
                int(self.defaults["height"]) // self.scale_s, int(self.defaults["width"]) // self.scale_s)

    def chunk_slice(self, k: int) -> slice:
        """The latent frames of chunk ``k`` (``x[:, :, chunk_slice(k)]``)."""
        return chunk_slice(self.chunk_frames, k)

    def encode(self, prompts: list[str]) -> Conditioning:
        """UMT5 embeddings through the pipeline's own ``encode_prompt``, cached per prompt string."""
        return encode_with_empty_negative(self._cache, check_prompts(prompts), self._encode_batch, False)

    def _encode_batch(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        embeds, _ = self.pipe.encode_prompt(prompt=prompts, do_classifier_free_guidance=False,
                                            max_sequence_length=int(self.defaults["max_sequence_length"]),
                                            device=self.device, dtype=self.dtype)
        return {"prompt_embeds": embeds}

    # ------------------------------------------------------------------ one transformer call

    def _run(self, x: torch.Tensor, sigma: float | torch.Tensor, cond: Conditioning, start: int,
             past: CacheWindow | None, written: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None,
             own_from: int = 0, write_from: int = 0) -> torch.Tensor:
        """The flow prediction ``(B, C, f, H', W')`` of frames ``start..start+f`` at ``x``, attending to ``past``
        (per block) and to its own tokens from frame ``own_from`` of the call on, writing those from frame
        ``write_from`` on."""
        b, f = x.shape[0], x.shape[2]
        cos, sin = self._rope.__class__.forward(self._rope, x.new_empty(1, 1, start + f, *x.shape[3:], device="meta"))
        skip = start * self.tokens_per_frame
        self._rope.stream_call = StreamCall(cos[:, skip:].to(self.device), sin[:, skip:].to(self.device), past,
                                            written, own_from * self.tokens_per_frame,
                                            write_from * self.tokens_per_frame)
        timestep = sigma_batch(sigma, b, self.device) * 1000.0
        text = cond.tensors["prompt_embeds"].to(self.device, self.dtype)
        return self.transformer(hidden_states=x.to(self.device, self.dtype), timestep=timestep,
                                encoder_hidden_states=text, return_dict=False)[0]

    def _check_guidance(self, guidance: float) -> None:
        if float(guidance) != 1.0:
            raise UserError(f"guidance_scale={guidance}: a causal Wan generator samples without CFG (it is "
                            "distilled with guidance inside); use 1")

    # ------------------------------------------------------------------ the stream

    def initial_noise(self, n: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """Pure noise ``(n, C, F', H', W')`` float32 for the whole video."""
        return gaussian_noise((n, *self.latent_shape), generator, self.device)

    def sigmas(self, num_steps: int) -> torch.Tensor:
        """``(num_steps+1,)`` float32, 1 → 0: the authors' warped few-step grid. Their scheduler's 1000 training
        σ (``linspace(1, 0, 1001)[:-1]``, shifted) read at timesteps ``1000 − 1000·i/n`` (4 steps: 1000, 750,
        500, 250, their ``denoising_step_list`` with ``warp_denoising_step``), then 0."""
        n = check_num_steps(num_steps)
        shift = float(self.defaults["shift"])
        raw = torch.linspace(1.0, 0.0, 1001)[:-1]
        shifted = shift * raw / (1 + (shift - 1) * raw)
        picked = shifted[[round(1000 * i / n) for i in range(n)]]
        return torch.cat([picked, torch.zeros(1)]).float()

    def empty_cache(self, batch: int, guidance: float) -> CausalKVCache:
        """A cache of no chunks for ``batch`` streams."""
        self._check_guidance(guidance)
        return CausalKVCache((), batch, 0, ())

    def chunk_velocity(self, x_chunk: torch.Tensor, sigma: float, sigma_next: float, cache: CausalKVCache,
                       cond: Conditioning, guidance: float) -> torch.Tensor:
        """The flow prediction float32 ``(B, C, f_k, H', W')`` of chunk ``k = cache.num_chunks`` at ``x_chunk``,
        attending to the cached frames its window holds. Differentiable in the transformer's weights."""
        self._check_guidance(guidance)
        b, k = batch_size(x_chunk, cond), cache.num_chunks
        if cache.batch != b:
            raise UserError(f"chunk_velocity: the cache holds {cache.batch} streams for {b} chunks")
        if x_chunk.shape[2] != self.chunk_frames[k]:
            raise UserError(f"chunk_velocity: chunk {k} has {self.chunk_frames[k]} latent frames, got "
                            f"{x_chunk.shape[2]}")
        past = cache.window(x_chunk.shape[2], self.window, self.sink, self.tokens_per_frame)
        return self._run(x_chunk, sigma, cond, self.chunk_slice(k).start, past).float()

    def _append(self, cache: CausalKVCache, piece: torch.Tensor, j: int, sigma: float | torch.Tensor,
                cond: Conditioning) -> tuple[CausalKVCache, torch.Tensor]:
        """Chunk ``j``'s flow prediction at ``piece`` ``(B, C, f_j, H', W')`` and σ, reading what ``cache`` lets it
        (its kept frames through the window), and ``cache`` with the keys and values it wrote joined."""
        written: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        out = self._run(piece, sigma, cond, self.chunk_slice(j).start,
                        cache.window(piece.shape[2], self.window, self.sink, self.tokens_per_frame), written=written)
        start, f = self.chunk_slice(j).start, piece.shape[2]
        segment = CacheSegment(start, f, [written[i] for i in range(len(written))])
        cache = dataclasses.replace(cache, segments=cache.segments + (segment,), num_chunks=j + 1,
                                    kept=cache.kept + tuple(range(start, start + f)), held=start + f)
        return self._evict(cache), out

    def _evict(self, cache: CausalKVCache) -> CausalKVCache:
        """With ``cache_frames`` C, the cache as LongLive's rolling cache of C frames holds it when the next chunk
        is made: the sink, the last C − sink − chunk frames, and the frames a routing holds on to (``pinned``);
        without, every frame."""
        if self.cache_frames is None:
            return cache
        held, sink = cache.held, range(cache.sink_first, min(cache.sink_first + self.sink, cache.held))
        recent = held - (self.cache_frames - self.sink - self.chunk_frames[0])
        return cache.resident(set(sink) | set(range(max(recent, 0), held)) | cache.pinned)

    @torch.no_grad()
    def _write(self, cache: CausalKVCache, clean: torch.Tensor, last: int, cond: Conditioning) -> CausalKVCache:
        """``cache`` with the clean chunks after it up to ``last`` of ``clean`` written in order, each run at
        timestep 0 (their ``context_noise``), joining the resident cache and the chunks read next."""
        for j in range(cache.num_chunks, last + 1):
            cache, _ = self._append(cache, clean[:, :, self.chunk_slice(j)], j, 0.0, cond)
        return cache

    def append_chunks(self, cache: CausalKVCache, clean: torch.Tensor, cond: Conditioning,
                      guidance: float) -> CausalKVCache:
        """A new cache holding the clean chunks ``0..k`` of ``clean`` ``(B, C, F_{≤k}, H', W')``: the chunks after
        ``cache``'s written as the authors' cache step does, each reading the history ``cache`` routes to
        (``cache`` is left as it is)."""
        self._check_guidance(guidance)
        k = self._chunks_in(clean, "append_chunks", least=1) - 1
        return self._write(cache, clean, k, cond)

    def history_cache(self, clean: torch.Tensor, keep: Sequence[int] | KeptFrames, cond: Conditioning,
                      guidance: float) -> CausalKVCache:
        """The cache the next chunk reads after the clean chunks of ``clean`` ``(B, C, F_{<k}, H', W')``, reading
        only the chunks (or frames) ``keep`` (KV routing): every chunk written as the stream writes it, then
        routed (:meth:`reroute`). Keeping every chunk is :meth:`append_chunks`' cache."""
        self._check_guidance(guidance)
        k = self._chunks_in(clean, "history_cache", least=0)
        return self.reroute(self._write(self.empty_cache(clean.shape[0], guidance), clean, k - 1, cond), keep)

    def reroute(self, cache: CausalKVCache, keep: Sequence[int] | KeptFrames) -> CausalKVCache:
        """``cache`` with the next chunk reading only the resident chunks ``keep``, or the resident frames
        ``keep.frames`` (:class:`KeptFrames`), their entries as written."""
        held, alive = cache.held, cache.alive()
        if isinstance(keep, KeptFrames):
            kept = tuple(sorted({int(f) for f in keep.frames}))
            if any(not 0 <= f < held for f in kept):
                raise UserError(f"history routing: frames {list(keep.frames)} lie outside the {held} latent frames "
                                "of the history")
            gone = [f for f in kept if f not in alive]
            if gone:
                raise UserError(f"history routing: frames {gone} have left the model's resident cache "
                                f"(model.defaults.cache_frames={self.cache_frames}); route frames it still holds")
            # the routed frames stay while the routing holds (their fixed memory tokens, cloned at first use)
            return dataclasses.replace(cache, kept=kept, pinned=frozenset(kept))
        chunks = sorted({int(j) for j in keep})
        if any(not 0 <= j < cache.num_chunks for j in chunks):
            raise UserError(f"history routing: keep={list(keep)} names chunks outside the {cache.num_chunks} chunks "
                            "of the history")
        # chunks that have left a resident cache are not read (their rolling cache no longer holds them)
        return dataclasses.replace(cache, kept=tuple(f for j in chunks for f in range(self.chunk_slice(j).start,
                                                                                     self.chunk_slice(j).stop)
                                                     if f in alive), pinned=frozenset())

    @torch.no_grad()
    def switch_prompt(self, cache: CausalKVCache, clean: torch.Tensor, cond: Conditioning,
                      guidance: float) -> CausalKVCache:
        """The cache the next chunk reads after a prompt switch to ``cond``, the stream's clean chunks so far
        ``clean`` ``(B, C, F_{<k}, H', W')``: LongLive's ``_recache_after_switch``. The last ``n`` frames
        (``attention_window``, or every frame without one) are run again in one call at timestep 0 under the new
        prompt (no mask inside the call, as theirs). Their cache of ``cache_frames`` slots decides the rest: once
        the window has moved past the sink, with ``global_sink`` the sink's entries stay and are read, the call's
        frames whose slots the sink holds are not written, and the call reads its last ``window − sink`` frames;
        without ``global_sink`` the cache is emptied first and the recached frames' first ``sink_frames`` become
        the sink (as their inference cache of ``window`` slots). The written entries supersede the frames'
        earlier ones; the history read is every resident frame (from the recached ones on without
        ``global_sink``)."""
        self._check_guidance(guidance)
        start = sum(self.chunk_frames[:self._chunks_in(clean, "switch_prompt", least=1)])
        if cache.held != start:
            raise UserError(f"switch_prompt: the cache holds {cache.held} frames for {start} clean frames")
        n = start if self.window is None else min(self.window, start)
        first = start - n
        past, own_from, write_from, kept_from = None, 0, 0, 0
        if first > 0 and self.global_sink and self.sink > 0:  # their recompute: the sink's slots left as written
            slot = min(start, self.cache_frames or start) - n  # the slot the call's first frame writes
            write_from = max(0, self.sink - slot)
            own_from = n - (self.window - self.sink)
            past = cache.pieces(range(cache.sink_first, cache.sink_first + self.sink), self.tokens_per_frame)
        elif first > 0 and not self.global_sink:
            if (self.cache_frames or start) > self.window:
                raise UserError(f"model.defaults.global_sink=false with cache_frames={self.cache_frames} larger "
                                f"than the attention window ({self.window}): their emptied cache would read blank "
                                "sink slots; set cache_frames to the window or global_sink to true")
            kept_from = first
        written: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._run(clean[:, :, first:start], 0.0, cond, first, past, written=written, own_from=own_from,
                  write_from=write_from)
        segment = CacheSegment(first + write_from, n - write_from, [written[i] for i in range(len(written))])
        cache = dataclasses.replace(cache, segments=cache.segments + (segment,), pinned=frozenset())
        alive = cache.alive()
        return self._evict(dataclasses.replace(cache, kept=tuple(f for f in range(kept_from, start) if f in alive),
                                               sink_first=kept_from if not self.global_sink else cache.sink_first))

    def _chunks_in(self, clean: torch.Tensor, what: str, least: int) -> int:
        """How many whole chunks ``clean`` ``(B, C, F, H', W')`` holds (at least ``least``)."""
        starts = [sum(self.chunk_frames[:j]) for j in range(len(self.chunk_frames) + 1)]
        if clean.shape[2] not in starts[least:]:
            raise UserError(f"{what}: {clean.shape[2]} latent frames are not a whole number of chunks "
                            f"{self.chunk_frames}")
        return starts.index(clean.shape[2])

    # ------------------------------------------------------------------ the FlowPolicy half

    def velocity(self, x: torch.Tensor, sigma: float | torch.Tensor, cond: Conditioning, guidance: float) -> torch.Tensor:
        """``v(x, σ | c)`` float32 ``(B, C, F', H', W')`` of the whole video at one σ, block-causal: chunk by chunk,
        each reading the earlier chunks' entries at the same σ through the window (the training path, not how
        the stream is sampled). Differentiable through every chunk's entries."""
        self._check_guidance(guidance)
        batch_size(x, cond)
        cache, out = self.empty_cache(x.shape[0], guidance), []
        for j in range(len(self.chunk_frames)):
            cache, v = self._append(cache, x[:, :, self.chunk_slice(j)], j, sigma, cond)
            out.append(v)
        return torch.cat(out, dim=2).float()

    def unconditional_velocity(self, x: torch.Tensor, sigma: float | torch.Tensor, cond: Conditioning) -> torch.Tensor:
        raise UserError("a causal Wan generator has no unconditional branch (it samples without CFG)")

    def decode(self, x0: torch.Tensor) -> torch.Tensor:
        """Latents ``(B, C, F', H', W')`` → videos ``(B, F, 3, H, W)`` float32 in [0, 1], de-normalised with the
        VAE's ``latents_mean`` / ``latents_std`` as ``WanPipeline`` does; differentiable in ``x0``."""
        mean, std = vae_latent_stats(self)
        videos = decode_in_chunks(self.vae, x0, self.options.decode_batch_size,
                                  lambda chunk: (chunk.to(self.device, torch.float32) * std + mean).to(self.vae.dtype))
        return videos.permute(0, 2, 1, 3, 4).contiguous()


def convert_generator(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The authors' generator weights (their ``CausalWanModel``: Wan's original names, under ``model.`` as their
    ``WanDiffusionWrapper`` saves them) in ``WanTransformer3DModel``'s names, through diffusers' own Wan
    single-file conversion."""
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    stripped = {(name[len("model."):] if name.startswith("model.") else name): value for name, value in state.items()}
    return convert_wan_transformer_to_diffusers(stripped)
