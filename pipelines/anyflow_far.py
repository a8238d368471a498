"""AnyFlow-FAR streaming text-to-video as a :class:`flowalign.protocols.StreamingPolicy`.

Wraps diffusers' ``AnyFlowFARPipeline`` (``AnyFlowFARTransformer3DModel``: a causal Wan 2.1 DiT with FAR's
chunk-wise block-causal attention, a compressed patch embedding for far context and AnyFlow's dual-timestep
flow-map embedding; UMT5 text; ``AutoencoderKLWan``) as its ``__call__`` runs, chunk by chunk:

* The video latents ``(B, C, F', H', W')`` (as Wan: ``F' = (F-1)/f_t + 1``) are split along frames by
  ``chunk_partition`` (the released checkpoints: 21 latent frames as ``1 + 3·6 + 2``); the initial noise is
  drawn for the whole video at once, as ``prepare_latents`` draws it.
* Chunk k is denoised on its own from its slice of the noise, over the flow-map scheduler's grid
  (``FlowMapEulerDiscreteScheduler``: ``linspace(1, 0, n+1)`` shifted), every step a jump from σ to the next
  σ' along the predicted *mean* velocity ``u(x, t=1000σ, r=1000σ')``: ``x' = x + (σ' − σ)·u``. The
  transformer sees only that chunk's tokens and attends to the earlier chunks through the KV cache.
* After a chunk is finished, the cache is re-encoded from every clean chunk so far (timestep 0), as the
  pipeline's ``encode_kv_cache`` does; chunks beyond ``full_chunk_limit`` enter it in compressed form.
* CFG ``u_u + w(u_c − u_u)`` against the empty prompt, with the cache held for both halves
  (``[uncond; cond]`` along the batch, the pipeline's order).

The KV cache is a first-class value here (:class:`KVCache`): rollouts keep the cache each chunk started
from, and trainers fork a stream at a chunk by repeating that cache. Caches are never written in place once made: appending a
chunk returns a new cache, so forks stay independent.

The FlowPolicy half (``velocity`` over a whole video) is the transformer's causal training path: every chunk
at the same σ attending to the earlier chunks' noisy tokens through FAR's block mask. It is the model's
function, but not how the stream is sampled; streaming trainers use :meth:`chunk_velocity`, and
``flowalign.sampling.streaming`` samples every streaming policy chunk by chunk (evaluation included).

LoRA: the pipeline mixes in ``WanLoraLoaderMixin``, so adapters are saved where its ``load_lora_weights``
reads them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from diffusers import AnyFlowFARPipeline, AutoencoderKLWan, FlowMapEulerDiscreteScheduler
from diffusers.models.transformers.transformer_anyflow_far import AnyFlowCausalAttnProcessor
from torch.nn.attention.flex_attention import BlockMask, create_mask

from flowalign.errors import UserError
from flowalign.families import FamilySpec
from flowalign.protocols import Conditioning
from pipelines import lora as lora_utils
from pipelines._common import SAMPLING_KEYS
from pipelines._common import ATTENTION_LORA_TARGETS, PromptCache, batch_size, cfg_batch, cfg_combine, check_multiple
from pipelines._common import check_num_steps, check_prompts, chunk_slice, decode_in_chunks
from pipelines._common import encode_with_empty_negative
from pipelines._common import gaussian_noise, make_trainable, merge_defaults, negative_conditioning, open_pipeline
from pipelines._common import require_scheduler, sigma_batch, text_encoders, vae_latent_stats, zeros_factory
from pipelines.memory import pin_processor_backend

#: the self- and cross-attention projections of every block, as for Wan
DEFAULT_LORA_TARGETS = ATTENTION_LORA_TARGETS


class CausalAttentionOnSDPA(AnyFlowCausalAttnProcessor):
    """The causal self-attention processor on scaled-dot-product attention instead of flex attention: torch's
    flex attention has no backward on CPU. Mask-free calls (a chunk reading the KV cache) need no mask;
    calls with FAR's block mask (cache writes, the causal whole-video pass, clean-context training) get it
    as a dense boolean mask evaluated from the same ``mask_mod`` (:func:`dense_attention_mask`). Both
    compute the same softmax attention over the same (padded) keys."""

    #: the last block mask converted and its dense form, shared by every block's processor: one forward
    #: passes the same mask to all of its blocks, so it is evaluated once, not once per block
    _dense: tuple[BlockMask, torch.Tensor] | None = None

    def __init__(self) -> None:
        super().__init__()
        pin_processor_backend(self, "native")  # diffusers' parent accepts flex only

    def __call__(self, attn: Any, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: Any = None, **kwargs: Any) -> torch.Tensor:
        if isinstance(attention_mask, BlockMask):
            last = CausalAttentionOnSDPA._dense
            if last is None or last[0] is not attention_mask:
                last = CausalAttentionOnSDPA._dense = (attention_mask,
                                                       dense_attention_mask(attention_mask, hidden_states.device))
            attention_mask = last[1]
        return super().__call__(attn, hidden_states, encoder_hidden_states, attention_mask, **kwargs)


def dense_attention_mask(mask: BlockMask, device: torch.device) -> torch.Tensor:
    """``(Q, K)`` bool: ``mask``'s token-level pattern (``True``: attend). A query row that may attend to no key
    (the padding FAR adds up to a multiple of 128) attends to itself instead: flex attention returns zeros for
    such rows, SDPA would return NaN, and the rows are cut off after the attention either way."""
    q_len, kv_len = mask.seq_lengths
    dense = create_mask(mask.mask_mod, None, None, q_len, kv_len, device=device)[0, 0]
    empty = ~dense.any(dim=1)
    # an empty row r attends to key min(r, kv_len − 1), set through a mask: indexing the empty rows (a count
    # that depends on the values) would make the host wait for the device
    own_key = torch.arange(q_len, device=device).clamp(max=kv_len - 1)
    return dense | (empty[:, None] & (torch.arange(kv_len, device=device)[None, :] == own_key[:, None]))


def attend_with_sdpa(transformer: torch.nn.Module) -> None:
    """Give every causal self-attention of ``transformer`` a :class:`CausalAttentionOnSDPA` processor."""
    for module in transformer.modules():
        if type(getattr(module, "processor", None)) is AnyFlowCausalAttnProcessor:
            module.set_processor(CausalAttentionOnSDPA())


@dataclass
class KVCache:
    """The transformer's key/value cache after ``num_chunks`` clean chunks, for a batch of streams.

    ``layers[i]``: block i's ``{"full_cache", "compressed_cache"}``, each ``(2, B', heads, tokens, head_dim)``
    (keys and values; diffusers' layout) with ``B' = 2B`` under CFG (``[uncond; cond]``) and ``B`` otherwise.
    ``kept``: the chunks whose keys and values it holds, in stream order: all ``0..num_chunks-1`` unless the
    history was routed (:meth:`AnyFlowFARPolicy.history_cache`).
    """

    layers: dict[int, dict[str, torch.Tensor]]
    num_chunks: int
    batch: int
    cfg: bool
    kept: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.kept is None:
            self.kept = tuple(range(self.num_chunks))

    def _rows(self, index: list[int]) -> list[int]:
        return index + [self.batch + i for i in index] if self.cfg else index

    def select(self, index: list[int] | torch.Tensor) -> "KVCache":
        """The caches of some streams, in the given order (repeat an index to fork a stream)."""
        idx = torch.as_tensor(index, dtype=torch.long).flatten().tolist()
        rows = torch.tensor(self._rows(idx), dtype=torch.long)
        on: dict[torch.device, torch.Tensor] = {}  # the index copied once to each device, without blocking
        layers = {i: {k: t.index_select(1, on.setdefault(t.device, rows.to(t.device, non_blocking=True)))
                      for k, t in layer.items()} for i, layer in self.layers.items()}
        return KVCache(layers, self.num_chunks, len(idx), self.cfg, self.kept)

    def repeat_interleave(self, repeats: int) -> "KVCache":
        """Each stream's cache ``repeats`` times in place: a group of forks sharing one history."""
        return self.select([i for i in range(self.batch) for _ in range(repeats)])



class AnyFlowFARPolicy(lora_utils.AdapterMethods):
    """AnyFlow-FAR streaming text-to-video policy (see :class:`flowalign.protocols.StreamingPolicy`).

    ``Conditioning.tensors``: ``prompt_embeds (B, L, D)`` (UMT5) and, when ``guidance_scale > 1``,
    ``negative_prompt_embeds`` of the empty prompt.
    """

    family = "anyflow_far"
    #: the model.defaults keys it reads
    sampling_keys: frozenset[str] = SAMPLING_KEYS | {"chunk_partition", "use_mean_velocity"}
    is_video = True
    streaming = True

    @staticmethod
    def chunk_frames_of(config: Any, size: dict[str, Any]) -> int:
        """Latent frames of the longest chunk (``flowalign plan``: a streaming trainer's training forward)."""
        return max(int(c) for c in (size.get("chunk_partition") or config.chunk_partition))

    @staticmethod
    def kv_cache_bytes(config: Any, size: dict[str, Any], dtype_bytes: int) -> float:
        """Bytes of the caches one streamed sample keeps (``flowalign plan``): the cache each chunk starts from is
        one of its own, sized as the pipeline sizes it (:func:`empty_cache_layers`), one a chunk (CFG's two rows
        a sample under guidance)."""
        f_t, f_s = int(size.get("vae_scale_temporal") or 4), int(size.get("vae_scale_spatial") or 8)
        partition = [int(c) for c in (size.get("chunk_partition") or config.chunk_partition)]
        rows = 2 if float(size.get("guidance_scale") or 1.0) > 1 else 1
        hw = (int(size["height"]) // f_s, int(size["width"]) // f_s)
        layers = empty_cache_layers(config, rows, hw, partition, "meta", torch.float32)
        one = sum(t.numel() for layer in layers.values() for t in layer.values())
        return float(len(partition) * one * dtype_bytes)

    def __init__(self, path: str | Path, **options: Any) -> None:
        """``options``: :class:`pipelines._common.PolicyOptions`; ``decode_batch_size`` defaults to 2 videos."""
        opts = open_pipeline(self, AnyFlowFARPipeline, path, options, float32_vae=AutoencoderKLWan,
                             decode_batch_size=2)
        require_scheduler(self.pipe, FlowMapEulerDiscreteScheduler, path, "AnyFlow-FAR")
        self.scale_t, self.scale_s = self.pipe.vae_scale_factor_temporal, self.pipe.vae_scale_factor_spatial
        config = self.transformer.config
        # the pipeline's defaults: 480 x 832, 81 frames, the transformer's chunk partition; the released
        # distilled checkpoints sample in 4 flow-map steps without CFG; a model trained as a plain flow
        # (r = t) sets use_mean_velocity false in flowalign.json and steps with its instantaneous velocity,
        # as the pipeline's use_mean_velocity=False does
        builtin = {"height": 480, "width": 832, "num_frames": 81, "num_steps": 4, "guidance_scale": 1.0,
                   "max_sequence_length": 512, "shift": float(self.pipe.scheduler.config.shift),
                   "chunk_partition": list(config.chunk_partition), "use_mean_velocity": True}
        self.defaults: dict[str, Any] = merge_defaults(builtin, path, opts.defaults)
        _, ph, pw = config.compressed_patch_size
        check_multiple(self.defaults, {"height": self.scale_s * ph, "width": self.scale_s * pw}, "this AnyFlow-FAR model")
        if (int(self.defaults["num_frames"]) - 1) % self.scale_t:
            raise UserError(f"num_frames={self.defaults['num_frames']}: num_frames - 1 must be a multiple of "
                            f"{self.scale_t} (the VAE's temporal factor)")
        self.chunk_frames: list[int] = [int(c) for c in self.defaults["chunk_partition"]]
        frames = self.latent_shape[1]
        if sum(self.chunk_frames) != frames or min(self.chunk_frames) < 1:
            raise UserError(f"chunk_partition={self.chunk_frames} must split the {frames} latent frames of "
                            f"num_frames={self.defaults['num_frames']} into chunks of at least one frame: give "
                            "defaults.chunk_partition summing to (num_frames - 1) / "
                            f"{self.scale_t} + 1")
        self.scheduler = FlowMapEulerDiscreteScheduler.from_config(self.pipe.scheduler.config,
                                                                   shift=float(self.defaults["shift"]))
        self.trainable: torch.nn.Module = make_trainable(self.transformer, opts, DEFAULT_LORA_TARGETS)
        if self.device.type == "cpu" and (opts.lora or opts.full_finetune):
            attend_with_sdpa(self.transformer)  # training on CPU: flex attention cannot differentiate there
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
        """UMT5 embeddings through the pipeline's own ``encode_prompt``, cached per prompt string; the CFG
        negative is the empty prompt."""
        prompts = check_prompts(prompts)
        return encode_with_empty_negative(self._cache, prompts, self._encode_batch,
                                          float(self.defaults["guidance_scale"]) > 1)

    def _encode_batch(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        embeds, _ = self.pipe.encode_prompt(prompt=prompts, do_classifier_free_guidance=False,
                                            max_sequence_length=int(self.defaults["max_sequence_length"]),
                                            device=self.device, dtype=self.dtype)
        return {"prompt_embeds": embeds}

    def _text(self, cond: Conditioning, cfg: bool) -> torch.Tensor:
        if cfg:
            (embeds,) = cfg_batch(cond, ["prompt_embeds"], self.defaults["guidance_scale"], self.device, self.dtype)
            return embeds
        return cond.tensors["prompt_embeds"].to(self.device, self.dtype)

    # ------------------------------------------------------------------ the stream

    def initial_noise(self, n: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """Pure noise ``(n, C, F', H', W')`` float32 for the whole video, drawn as ``prepare_latents`` draws it."""
        return gaussian_noise((n, *self.latent_shape), generator, self.device)

    def sigmas(self, num_steps: int) -> torch.Tensor:
        """``(num_steps+1,)`` float32, 1 → 0: the flow-map scheduler's shifted grid (every chunk uses it)."""
        self.scheduler.set_timesteps(check_num_steps(num_steps), device="cpu")
        return self.scheduler.sigmas.to(torch.float32).clone()

    def empty_cache(self, batch: int, guidance: float) -> KVCache:
        """A cache of no chunks for ``batch`` streams, sized as the pipeline sizes it for this video."""
        rows = 2 * batch if guidance > 1 else batch
        layers = empty_cache_layers(self.transformer.config, rows, self.latent_shape[2:], self.chunk_frames,
                                    self.device, self.dtype)
        return KVCache(layers, 0, batch, guidance > 1)

    def chunk_velocity(self, x_chunk: torch.Tensor, sigma: float, sigma_next: float, cache: KVCache,
                       cond: Conditioning, guidance: float) -> torch.Tensor:
        """The mean velocity ``u(x, σ → σ')`` float32 ``(B, C, f_k, H', W')`` of chunk ``k = cache.num_chunks``,
        attending to the cached chunks (``cache.kept``); CFG inside when ``guidance > 1``. With the default
        ``use_mean_velocity`` false, the instantaneous velocity ``u(x, σ → σ)`` instead.
        Differentiable in the transformer's weights (the cache is a constant)."""
        b, cfg = batch_size(x_chunk, cond), guidance > 1
        if cache.batch != b or cache.cfg != cfg:
            raise UserError(f"chunk_velocity: the cache holds {cache.batch} streams "
                            f"({'with' if cache.cfg else 'without'} CFG) for {b} chunks at guidance {guidance}: "
                            "make the cache with empty_cache(batch, guidance) and the same guidance")
        k = cache.num_chunks
        if x_chunk.shape[2] != self.chunk_frames[k]:
            raise UserError(f"chunk_velocity: chunk {k} has {self.chunk_frames[k]} latent frames, got {x_chunk.shape[2]}")
        hidden = x_chunk.to(self.device, self.dtype).permute(0, 2, 1, 3, 4)  # (B, f, C, H, W), the FAR layout
        t = sigma_batch(sigma, b, self.device) * 1000.0
        r = sigma_batch(sigma_next if self.defaults["use_mean_velocity"] else sigma, b, self.device) * 1000.0
        if cfg:
            hidden, t, r = torch.cat([hidden, hidden]), torch.cat([t, t]), torch.cat([r, r])
        # the transformer sees the kept history chunks then this one (positions follow that sequence)
        history = [self.chunk_frames[j] for j in cache.kept]
        out = read_cache_velocity(self.transformer, cache.layers, history, hidden, t, r, self._text(cond, cfg))
        out = out.permute(0, 2, 1, 3, 4)
        return cfg_combine(out, guidance) if cfg else out.float()

    def append_chunks(self, cache: KVCache, clean: torch.Tensor, cond: Conditioning, guidance: float) -> KVCache:
        """A new cache of the clean chunks ``0..k`` in ``clean`` ``(B, C, F_{≤k}, H', W')``, re-encoded at
        timestep 0 as the pipeline's ``encode_kv_cache`` does (``cache``, of chunks ``0..k-1``, is left as it is)."""
        k = cache.num_chunks
        if clean.shape[2] != sum(self.chunk_frames[:k + 1]):
            raise UserError(f"append_chunks: chunks 0..{k} have {sum(self.chunk_frames[:k + 1])} latent frames, "
                            f"got {clean.shape[2]}")
        return self.history_cache(clean, range(k + 1), cond, guidance)

    @torch.no_grad()
    def history_cache(self, clean: torch.Tensor, keep: Sequence[int], cond: Conditioning, guidance: float) -> KVCache:
        """The cache the next chunk reads after the clean chunks in ``clean`` ``(B, C, F_{<k}, H', W')``, holding
        only the chunks ``keep`` (KV routing: the next chunk attends to that history, laid out as if it were
        the whole stream so far). Keeping every chunk is the pipeline's own cache: the cache step re-encodes
        every chunk it holds, so a cache is a function of the kept chunks alone."""
        starts = [sum(self.chunk_frames[:j]) for j in range(len(self.chunk_frames) + 1)]
        if clean.shape[2] not in starts:
            raise UserError(f"history_cache: {clean.shape[2]} latent frames are not a whole number of chunks "
                            f"{self.chunk_frames}")
        k = starts.index(clean.shape[2])
        kept = tuple(sorted({int(j) for j in keep}))
        if any(not 0 <= j < k for j in kept):
            raise UserError(f"history_cache: keep={list(keep)} names chunks outside the {k} chunks of the history")
        cfg = guidance > 1
        cache = self.empty_cache(clean.shape[0], guidance)
        if kept:
            frames = torch.cat([clean[:, :, self.chunk_slice(j)] for j in kept], dim=2)
            hidden = frames.to(self.device, self.dtype).permute(0, 2, 1, 3, 4)
            if cfg:
                hidden = torch.cat([hidden, hidden])
            write_cache(self.transformer, cache.layers, [self.chunk_frames[j] for j in kept], hidden,
                        self._text(cond, cfg))
        return KVCache(cache.layers, k, cache.batch, cache.cfg, kept)

    # ------------------------------------------------------------------ the FlowPolicy half

    def velocity(self, x: torch.Tensor, sigma: float | torch.Tensor, cond: Conditioning, guidance: float) -> torch.Tensor:
        """``v(x, σ | c)`` float32 ``(B, C, F', H', W')`` of the whole video at one σ through the causal
        training path (instantaneous velocity: ``r = t``); see the module docstring for why sampling does
        not use it."""
        b, cfg = batch_size(x, cond), guidance > 1
        hidden = x.to(self.device, self.dtype).permute(0, 2, 1, 3, 4)
        t = sigma_batch(sigma, b, self.device) * 1000.0
        if cfg:
            hidden, t = torch.cat([hidden, hidden]), torch.cat([t, t])
        t = t[:, None].expand(-1, hidden.shape[1])
        out = self.transformer(hidden_states=hidden, timestep=t, r_timestep=t, encoder_hidden_states=self._text(cond, cfg),
                               chunk_partition=self.chunk_frames, return_dict=False)[0]
        out = out.permute(0, 2, 1, 3, 4)
        return cfg_combine(out, guidance) if cfg else out.float()

    def unconditional_velocity(self, x: torch.Tensor, sigma: float | torch.Tensor, cond: Conditioning) -> torch.Tensor:
        """The CFG negative's :meth:`velocity` float32 (one forward of batch B)."""
        return self.velocity(x, sigma, negative_conditioning(cond, ["prompt_embeds"], self.defaults["guidance_scale"]), 1.0)

    def decode(self, x0: torch.Tensor) -> torch.Tensor:
        """Latents ``(B, C, F', H', W')`` → videos ``(B, F, 3, H, W)`` float32 in [0, 1], de-normalised with the
        VAE's ``latents_mean`` / ``latents_std`` as the pipeline does; differentiable in ``x0``."""
        mean, std = vae_latent_stats(self)  # copied to the device once, not at every decode
        videos = decode_in_chunks(self.vae, x0, self.options.decode_batch_size,
                                  lambda chunk: (chunk.to(self.device, torch.float32) * std + mean).to(self.vae.dtype))
        return videos.permute(0, 2, 1, 3, 4).contiguous()


def empty_cache_layers(config: Any, rows: int, latent_hw: Sequence[int], chunk_frames: Sequence[int],
                       device: str | torch.device, dtype: torch.dtype) -> dict[int, dict[str, torch.Tensor]]:
    """Zeroed ``{"full_cache", "compressed_cache"}`` per block, each ``(2, rows, heads, tokens, head_dim)``, sized
    as the pipeline sizes them: ``full_chunk_limit`` longest chunks at full resolution, the rest compressed."""
    h, w = latent_hw
    full_tokens = (h // config.patch_size[1]) * (w // config.patch_size[2])
    compressed_tokens = (h // config.compressed_patch_size[1]) * (w // config.compressed_patch_size[2])
    longest, chunks = max(chunk_frames), len(chunk_frames)
    new = zeros_factory(device, dtype)
    return {i: {"full_cache": new(2, rows, config.num_attention_heads, config.full_chunk_limit * longest * full_tokens,
                                  config.attention_head_dim),
                "compressed_cache": new(2, rows, config.num_attention_heads,
                                        (chunks - config.full_chunk_limit + 1) * longest * compressed_tokens,
                                        config.attention_head_dim)}
            for i in range(config.num_layers)}


def write_cache(transformer: torch.nn.Module, layers: dict[int, dict[str, torch.Tensor]], partition: list[int],
                clean: torch.Tensor, text: torch.Tensor) -> None:
    """The pipeline's cache step: the clean chunks ``clean`` ``(B, F, C, H', W')`` (FAR layout, split by
    ``partition``) encoded at timestep 0 under the cache-mode block mask, their keys and values written into
    ``layers``. Differentiable when gradients are on (pretraining learns the history it writes)."""
    device = clean.device
    zeros = torch.zeros(clean.shape[0], clean.shape[1], device=device)
    mask = transformer.build_attention_mask(chunk_partition=partition, height=clean.shape[-2], width=clean.shape[-1],
                                            device=device, mode="cache")
    transformer(hidden_states=clean, timestep=zeros, r_timestep=zeros, encoder_hidden_states=text,
                chunk_partition=partition, attention_mask=mask, kv_cache=layers,
                kv_cache_flag={"num_cached_chunks": len(partition) - 1, "is_cache_step": True}, return_dict=False)


def read_cache_velocity(transformer: torch.nn.Module, layers: dict[int, dict[str, torch.Tensor]], history: list[int],
                        hidden: torch.Tensor, t: torch.Tensor, r: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
    """The pipeline's denoising call: the velocity ``(B, f, C, H', W')`` of one chunk ``hidden`` (FAR layout) at
    timesteps ``t``, ``r`` ``(B,)`` (``1000σ``), attending to the cached chunks of ``history`` (their frame counts)."""
    frames = hidden.shape[1]
    out, _ = transformer(hidden_states=hidden, timestep=t[:, None].expand(-1, frames),
                         r_timestep=r[:, None].expand(-1, frames), encoder_hidden_states=text,
                         chunk_partition=[*history, frames], kv_cache=layers,
                         kv_cache_flag={"num_cached_chunks": len(history), "is_cache_step": False}, return_dict=False)
    return out


def transformer_inputs(config: Any, batch: int, size: dict[str, Any], *, device: str | torch.device = "meta",
                       dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """The whole-video causal pass of :meth:`AnyFlowFARPolicy.velocity`: latents ``(B, 1 + (F-1)/4, C, H/8, W/8)``
    in the FAR layout, per-frame timesteps, UMT5 text ``(B, L, D)``, the chunk partition (``size``'s, else the
    config's). ``size``'s
    optional ``vae_scale_temporal`` / ``vae_scale_spatial`` replace the released VAE's 4 and 8 (a tiny twin's)."""
    new = zeros_factory(device, dtype)
    f_t, f_s = int(size.get("vae_scale_temporal") or 4), int(size.get("vae_scale_spatial") or 8)
    frames = 1 + (int(size["num_frames"] or 1) - 1) // f_t
    h, w = int(size["height"]) // f_s, int(size["width"]) // f_s
    t = torch.full((batch, frames), 500.0, device=device)
    return dict(hidden_states=new(batch, frames, config.in_channels, h, w), timestep=t, r_timestep=t,
                encoder_hidden_states=new(batch, int(size["max_sequence_length"]), config.text_dim),
                chunk_partition=[int(c) for c in (size.get("chunk_partition") or config.chunk_partition)],
                return_dict=False)


SPEC = FamilySpec(
    name="anyflow_far", policy=AnyFlowFARPolicy, pipelines=("AnyFlowFARPipeline",),
    transformers=("AnyFlowFARTransformer3DModel",), lora_targets=tuple(DEFAULT_LORA_TARGETS),
    # the pipeline's defaults: 480 x 832, 81 frames; the distilled checkpoints: 4 flow-map steps, no CFG
    size={"height": 480, "width": 832, "num_frames": 81, "max_sequence_length": 512}, num_steps=4, guidance=1.0,
    cfg="cfg", transformer_inputs=transformer_inputs, tiny={"anyflow_far": "pipelines.tiny_twins.anyflow_far"},
    architectures=("anyflow-far-wan2.1-1.3b",),
)
