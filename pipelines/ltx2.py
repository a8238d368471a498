"""LTX-2 text-to-video with its audio stream as a :class:`flowalign.protocols.FlowPolicy`.

Wraps diffusers' ``LTX2Pipeline`` as its ``__call__`` uses it for text to video+audio:

* State ``x``: the token sequence the transformer reads, video tokens followed by audio tokens,
  ``(B, S_v + S_a, C)`` float32. Video: latents ``(B, C, F', H', W')`` with ``F' = (F-1)/f_t + 1``,
  ``H' = H/f_s`` (the release: C = 128, f_t = 8, f_s = 32) packed by ``_pack_latents`` into
  ``S_v = F'·H'·W'`` tokens (patch 1). Audio: latents ``(B, C_a, L, M')`` (the release: C_a = 8,
  M' = 64 mel bins / 4 = 16) packed by ``_pack_audio_latents`` into ``S_a = L`` tokens of width
  ``C_a·M'``, with ``L = round(F / frame_rate · sample_rate / hop / 4)`` (121 frames at 24 fps: 126).
  Both widths are 128 in the release; a checkpoint where they differ is refused. Both streams live in the
  pipeline's normalised latent space (the noise is drawn there), so the trainers' elementwise SDE steps,
  log-probs over all non-batch dims and ``latent_shape = (S_v + S_a, C)`` cover video and audio jointly,
  as the pipeline denoises them jointly.
* Noise: ``randn((B, C, F', H', W'))`` then ``randn((B, C_a, L, M'))`` from one generator, each packed:
  ``prepare_latents`` and ``prepare_audio_latents`` in the pipeline's order, so ``pipe(generator=g)`` with
  the same seed starts from the same ``x``.
* Timestep ``t = 1000·σ`` for both streams, passed as ``timestep`` and ``sigma``, with the pipeline's default
  ``use_cross_timestep=True``; RoPE coordinates from ``(F', H', W')`` at ``fps = frame_rate`` and from ``L``
  (the transformer's own ``prepare_video_coords`` / ``prepare_audio_coords``, as the pipeline calls them).
* Text: Gemma 3 through the pipeline's ``encode_prompt`` (left padding, every hidden state stacked,
  ``max_sequence_length`` tokens, 1024 by default), then the ``LTX2TextConnectors`` (frozen and
  timestep-free, so they run once per prompt at encode time): video and audio text tokens and their mask.
* CFG ``v_u + w(v_c − v_u)`` against the empty prompt (``encode_prompt``'s ``negative_prompt=None`` is
  ``""``), ``w`` = ``guidance`` on the video tokens and the ``audio_guidance_scale`` default on the audio
  tokens (the pipeline's separate audio scale; None: the video's ``w``). The pipeline mixes in x0 space
  (``x0_c + (w−1)(x0_c − x0_u)`` at the step's σ), which is the same velocity up to float rounding.
  ``guidance <= 1`` is the conditional velocity of both streams. Kept off: spatio-temporal guidance
  (``stg_scale = audio_stg_scale = 0``), modality-isolation guidance (``modality_scale =
  audio_modality_scale = 1``) and guidance rescale (``guidance_rescale = audio_guidance_rescale = 0``);
  each adds a transformer pass or a batch statistic a per-step Gaussian policy does not have. Call
  ``pipe(...)`` with those settings to compare.
* Sigma grid: ``linspace(1, 1/n, n)`` through the checkpoint's ``FlowMatchEulerDiscreteScheduler`` with
  ``mu = calculate_shift(S_v, base_image_seq_len, max_image_seq_len, base_shift, max_shift)`` (the release:
  dynamic exponential shift from the video token count, stretched to end at ``shift_terminal = 0.1``), then
  0, exactly as ``__call__`` sets it.
* Decode: video tokens unpacked, ``_denormalize_latents`` (the VAE's per-channel mean/std and
  ``scaling_factor``), ``vae.decode`` in float32 (timestep 0 where the VAE is timestep-conditioned: the
  pipeline's ``decode_timestep=0`` leaves the latents unchanged) to ``(B, F, 3, H, W)`` in [0, 1];
  :meth:`LTX2Policy.decode_audio`: audio tokens ``_denormalize_audio_latents``, unpacked, ``audio_vae.decode``
  to a mel spectrogram and the vocoder to the waveform ``(B, channels, samples)``.

LoRA: ``LTX2Pipeline`` mixes in ``LTX2LoraLoaderMixin``; :meth:`save_adapter` writes the file its
``load_lora_weights`` reads (:func:`pipelines.lora.save_adapter`).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import numpy as np
import torch
from diffusers import AutoencoderKLLTX2Video, FlowMatchEulerDiscreteScheduler, LTX2Pipeline
from diffusers.pipelines.ltx2.pipeline_ltx2 import calculate_shift

from flowalign.errors import UserError
from flowalign.families import FamilySpec
from flowalign.protocols import Conditioning
from pipelines import lora as lora_utils
from pipelines._common import SAMPLING_KEYS
from pipelines._common import ATTENTION_LORA_TARGETS, PromptCache, batch_size, cfg_mix, check_multiple, check_num_steps
from pipelines._common import check_prompts, encode_with_empty_negative, gaussian_noise, make_trainable, merge_defaults
from pipelines._common import negative_conditioning, open_pipeline, require_scheduler, sigma_batch, text_encoders
from pipelines._common import zeros_factory

#: the attention projections of every block: video and audio self-attention (attn1, audio_attn1), their
#: text cross-attention (attn2, audio_attn2) and the audio↔video cross-attention
DEFAULT_LORA_TARGETS = ATTENTION_LORA_TARGETS
#: the conditioning tensors (the connectors' outputs), each with a ``negative_`` twin under CFG
KEYS = ["prompt_embeds", "audio_prompt_embeds", "prompt_attention_mask"]


class LTX2Policy(lora_utils.AdapterMethods):
    """LTX-2 text-to-video+audio policy (see :class:`flowalign.protocols.FlowPolicy` and the module docstring).

    ``Conditioning.tensors``: ``prompt_embeds (B, L, D)`` and ``audio_prompt_embeds (B, L, D)`` (the video and
    audio connectors' text tokens), ``prompt_attention_mask (B, L)`` and, when ``guidance_scale > 1``, the
    empty prompt's as ``negative_*``.
    """

    family = "ltx2"
    #: the model.defaults keys it reads
    sampling_keys: frozenset[str] = SAMPLING_KEYS | {"frame_rate", "audio_guidance_scale"}
    is_video = True

    def __init__(self, path: str | Path, **options: Any) -> None:
        """``options``: :class:`pipelines._common.PolicyOptions`; ``decode_batch_size`` defaults to 1 video."""
        opts = open_pipeline(self, LTX2Pipeline, path, options, float32_vae=AutoencoderKLLTX2Video,
                             decode_batch_size=1)
        require_scheduler(self.pipe, FlowMatchEulerDiscreteScheduler, path, "LTX-2")
        pipe = self.pipe
        self.audio_vae = pipe.audio_vae
        self.scale_t, self.scale_s = pipe.vae_temporal_compression_ratio, pipe.vae_spatial_compression_ratio
        self.patch, self.patch_t = pipe.transformer_spatial_patch_size, pipe.transformer_temporal_patch_size
        self.mel_bins = self.audio_vae.config.mel_bins // pipe.audio_vae_mel_compression_ratio
        config = self.transformer.config
        audio_width = self.audio_vae.config.latent_channels * self.mel_bins
        if config.audio_in_channels != audio_width or config.audio_in_channels != config.in_channels:
            raise UserError(f"{path}: video tokens are {config.in_channels} wide and audio tokens "
                            f"{config.audio_in_channels} ({audio_width} from the audio VAE); the ltx2 family keeps "
                            "both streams in one token sequence and needs the three equal, as LTX-2 releases have")
        # the pipeline's __call__ defaults: 512 × 768, 121 frames at 24 fps, 30 steps, CFG 3 (video) and 7
        # (audio), 1024 text tokens
        builtin = {"height": 512, "width": 768, "num_frames": 121, "frame_rate": 24.0, "num_steps": 30,
                   "guidance_scale": 3.0, "audio_guidance_scale": 7.0, "max_sequence_length": 1024}
        self.defaults: dict[str, Any] = merge_defaults(builtin, path, opts.defaults)
        # the pipeline's check_inputs refuses sides that are not multiples of 32, whatever the VAE factor
        side = max(32, self.scale_s * self.patch)
        check_multiple(self.defaults, {"height": side, "width": side}, "LTX-2 (the pipeline's check_inputs)")
        if (int(self.defaults["num_frames"]) - 1) % (self.scale_t * self.patch_t):
            raise UserError(f"num_frames={self.defaults['num_frames']}: num_frames - 1 must be a multiple of "
                            f"{self.scale_t * self.patch_t} (the VAE's temporal factor), e.g. 121 or 97")
        if float(self.defaults["frame_rate"]) <= 0:
            raise UserError(f"frame_rate={self.defaults['frame_rate']} must be positive (frames per second)")
        self.scheduler = copy.deepcopy(pipe.scheduler)
        self.trainable: torch.nn.Module = make_trainable(self.transformer, opts, DEFAULT_LORA_TARGETS)
        self._cache = PromptCache(opts.prompt_cache_size, text_encoders(pipe) + [pipe.connectors])

    # ------------------------------------------------------------------ shapes and text

    @property
    def video_grid(self) -> tuple[int, int, int]:
        """Latent ``(F', H', W')`` of one video at the default size (after the transformer's patching)."""
        frames = (int(self.defaults["num_frames"]) - 1) // self.scale_t + 1
        return (frames // self.patch_t, int(self.defaults["height"]) // self.scale_s // self.patch,
                int(self.defaults["width"]) // self.scale_s // self.patch)

    @property
    def audio_frames(self) -> int:
        """``L``, the audio latent length of ``num_frames`` at ``frame_rate``, rounded as the pipeline does."""
        per_second = (self.pipe.audio_sampling_rate / self.pipe.audio_hop_length
                      / float(self.pipe.audio_vae_temporal_compression_ratio))
        return round(int(self.defaults["num_frames"]) / float(self.defaults["frame_rate"]) * per_second)

    @property
    def latent_shape(self) -> tuple[int, int]:
        """``(S_v + S_a, C)`` of one sample: the video tokens, then the audio tokens."""
        f, h, w = self.video_grid
        return (f * h * w + self.audio_frames, self.transformer.config.in_channels)

    def split(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x (B, S_v + S_a, C)`` → video tokens ``(B, S_v, C)`` and audio tokens ``(B, S_a, C)``."""
        f, h, w = self.video_grid
        return x[:, : f * h * w], x[:, f * h * w:]

    def encode(self, prompts: list[str]) -> Conditioning:
        """Gemma 3 and the text connectors, cached per prompt string; the CFG negative is the empty prompt
        (the pipeline's ``negative_prompt=None``), encoded once."""
        prompts = check_prompts(prompts)
        return encode_with_empty_negative(self._cache, prompts, self._encode_batch,
                                          float(self.defaults["guidance_scale"]) > 1, KEYS)

    def _encode_batch(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        embeds, mask, _, _ = self.pipe.encode_prompt(
            prompt=prompts, do_classifier_free_guidance=False, max_sequence_length=int(self.defaults["max_sequence_length"]),
            device=self.device, dtype=self.dtype)
        # encode_prompt pads on the left (it sets the tokenizer so); the connectors must know the side
        video, audio, mask = self.pipe.connectors(embeds, mask, padding_side=self.pipe.tokenizer.padding_side)
        return dict(zip(KEYS, (video, audio, mask)))

    # ------------------------------------------------------------------ flow

    def initial_noise(self, n: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """Pure noise ``(n, S_v + S_a, C)`` float32: video then audio latents drawn from ``generator`` and
        packed, as ``prepare_latents`` and ``prepare_audio_latents`` draw them."""
        f, h, w = self.video_grid
        video = gaussian_noise((n, self.vae.config.latent_channels, f * self.patch_t, h * self.patch, w * self.patch),
                               generator, self.device)
        audio = gaussian_noise((n, self.audio_vae.config.latent_channels, self.audio_frames, self.mel_bins),
                               generator, self.device)
        return torch.cat([self.pipe._pack_latents(video, self.patch, self.patch_t),
                          self.pipe._pack_audio_latents(audio)], dim=1)

    def _forward(self, x: torch.Tensor, timestep: torch.Tensor, text: dict[str, torch.Tensor]) -> torch.Tensor:
        """One transformer pass over ``x (N, S_v + S_a, C)`` → velocities of the same shape, float32."""
        f, h, w = self.video_grid
        video, audio = self.split(x.to(self.device, self.dtype))
        v_video, v_audio = self.transformer(
            hidden_states=video, audio_hidden_states=audio, encoder_hidden_states=text["prompt_embeds"],
            audio_encoder_hidden_states=text["audio_prompt_embeds"], timestep=timestep, sigma=timestep,
            encoder_attention_mask=text["prompt_attention_mask"], audio_encoder_attention_mask=text["prompt_attention_mask"],
            num_frames=f, height=h, width=w, fps=float(self.defaults["frame_rate"]), audio_num_frames=self.audio_frames,
            isolate_modalities=False, spatio_temporal_guidance_blocks=None, perturbation_mask=None,
            use_cross_timestep=True, return_dict=False)
        return torch.cat([v_video.float(), v_audio.float()], dim=1)

    def _text(self, cond: Conditioning) -> dict[str, torch.Tensor]:
        # the mask stays integer (the pipeline passes the connectors' int64 mask)
        return {k: cond.tensors[k].to(self.device, None if k.endswith("mask") else self.dtype) for k in KEYS}

    def audio_guidance(self, guidance: float) -> float:
        """The audio tokens' CFG scale when the video's is ``guidance > 1``: the ``audio_guidance_scale`` default
        (None: ``guidance`` itself, as the pipeline's ``audio_guidance_scale=None``)."""
        scale = self.defaults.get("audio_guidance_scale")
        return float(guidance if scale is None else scale)

    def _guide(self, v_uncond: torch.Tensor, v_cond: torch.Tensor, guidance: float) -> torch.Tensor:
        """CFG per stream: ``guidance`` on the video tokens, :meth:`audio_guidance` on the audio tokens."""
        (u_video, u_audio), (c_video, c_audio) = self.split(v_uncond), self.split(v_cond)
        return torch.cat([cfg_mix(u_video, c_video, guidance),
                          cfg_mix(u_audio, c_audio, self.audio_guidance(guidance))], dim=1)

    def velocity(self, x: torch.Tensor, sigma: float | torch.Tensor, cond: Conditioning, guidance: float,
                 *, uncond: torch.Tensor | None = None) -> torch.Tensor:
        """``v(x, σ | c)`` float32 ``(B, S_v + S_a, C)``; CFG by one batched [uncond; cond] pass when w > 1, or
        by the conditional pass alone given ``uncond`` (:meth:`unconditional_velocity`)."""
        b = batch_size(x, cond)
        if uncond is not None and guidance > 1:
            return self._guide(uncond, self.velocity(x, sigma, cond, 1.0), guidance)
        timestep = sigma_batch(sigma, b, self.device) * 1000.0
        if guidance <= 1:
            return self._forward(x, timestep, self._text(cond))
        pos, neg = self._text(cond), self._text(negative_conditioning(cond, KEYS, self.defaults["guidance_scale"]))
        text = {k: torch.cat([neg[k], pos[k]]) for k in KEYS}
        out = self._forward(torch.cat([x, x]), torch.cat([timestep, timestep]), text)
        v_uncond, v_cond = out.chunk(2)
        return self._guide(v_uncond, v_cond, guidance)

    def unconditional_velocity(self, x: torch.Tensor, sigma: float | torch.Tensor, cond: Conditioning) -> torch.Tensor:
        """The CFG negative's velocity ``v_u`` float32 ``(B, S_v + S_a, C)`` (one forward of batch B)."""
        return self.velocity(x, sigma, negative_conditioning(cond, KEYS, self.defaults["guidance_scale"]), 1.0)

    def sigmas(self, num_steps: int) -> torch.Tensor:
        """``(num_steps+1,)`` float32, 1 → 0: ``linspace(1, 1/n, n)`` through the scheduler with ``mu`` from the
        video token count, as ``__call__`` sets it (the scheduler appends the final 0)."""
        n = check_num_steps(num_steps)
        f, h, w = self.video_grid
        config = self.scheduler.config
        mu = calculate_shift(f * h * w, config.get("base_image_seq_len", 1024), config.get("max_image_seq_len", 4096),
                             config.get("base_shift", 0.95), config.get("max_shift", 2.05))
        if n < 2 and self.scheduler.config.get("shift_terminal"):
            # the stretch to shift_terminal divides by 1 - σ_last, which is 0 for a one-step grid (NaN in the pipeline too)
            raise UserError(f"num_steps={num_steps}: this LTX-2 scheduler stretches its grid to end at "
                            f"shift_terminal={self.scheduler.config.shift_terminal}, which needs num_steps >= 2")
        self.scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / n, n), mu=mu, device="cpu")
        return self.scheduler.sigmas.to(torch.float32).clone()

    def video_latents(self, x0: torch.Tensor) -> torch.Tensor:
        """The video VAE's latents ``(B, C, F', H', W')`` of ``x0``: unpacked and denormalised (what
        ``pipe(..., output_type="latent").frames`` returns)."""
        f, h, w = self.video_grid
        z = self.pipe._unpack_latents(self.split(x0)[0], f, h, w, self.patch, self.patch_t)
        return self.pipe._denormalize_latents(z, self.vae.latents_mean, self.vae.latents_std, self.vae.config.scaling_factor)

    def audio_latents(self, x0: torch.Tensor) -> torch.Tensor:
        """The audio VAE's latents ``(B, C_a, L, M')`` of ``x0``: denormalised and unpacked (what
        ``pipe(..., output_type="latent").audio`` returns)."""
        tokens = self.pipe._denormalize_audio_latents(self.split(x0)[1], self.audio_vae.latents_mean,
                                                      self.audio_vae.latents_std)
        return self.pipe._unpack_audio_latents(tokens, self.audio_frames, num_mel_bins=self.mel_bins)

    def decode(self, x0: torch.Tensor) -> torch.Tensor:
        """``x0 (B, S_v + S_a, C)`` → videos ``(B, F, 3, H, W)`` float32 in [0, 1], ``decode_batch_size`` at a
        time; differentiable in ``x0`` (the VAE is frozen, not detached)."""
        out = []
        for chunk in x0.split(self.options.decode_batch_size):
            z = self.video_latents(chunk.to(self.device, torch.float32))
            # a timestep-conditioned VAE decodes at the pipeline's decode_timestep=0 (no decode noise)
            t = z.new_zeros(z.shape[0]) if self.vae.config.timestep_conditioning else None
            video = self.vae.decode(z, t, return_dict=False)[0]
            out.append((video.float() / 2 + 0.5).clamp(0, 1))
        return torch.cat(out).permute(0, 2, 1, 3, 4).contiguous()

    def decode_audio(self, x0: torch.Tensor) -> torch.Tensor:
        """``x0 (B, S_v + S_a, C)`` → waveforms ``(B, channels, samples)`` float32 at
        ``pipe.vocoder.config.output_sampling_rate`` (the audio VAE's mel spectrogram through the vocoder)."""
        z = self.audio_latents(x0.to(self.device, torch.float32)).to(self.audio_vae.dtype)
        mel = self.audio_vae.decode(z, return_dict=False)[0]
        return self.pipe.vocoder(mel.to(self.pipe.vocoder.dtype)).float()


def transformer_inputs(config: Any, batch: int, size: dict[str, Any], *, device: str | torch.device = "meta",
                       dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """The inputs :meth:`LTX2Policy.velocity` passes: video tokens ``(B, F'·H'·W', C)`` (f_t = 8, f_s = 32),
    audio tokens ``(B, L, C_a)`` at 24 fps (25 audio latents a second), the connectors' text tokens for
    both streams and their mask."""
    new = zeros_factory(device, dtype)
    frames = 1 + (int(size["num_frames"] or 1) - 1) // 8
    h, w = int(size["height"]) // 32, int(size["width"]) // 32
    audio = round(int(size["num_frames"] or 1) / 24.0 * 25)
    length = int(size["max_sequence_length"])
    # LTX-2.0 projects the connectors' caption-width tokens itself; per-modality connectors (LTX-2.3) emit
    # the transformer's cross-attention widths
    video_text = config.caption_channels if config.use_prompt_embeddings else config.cross_attention_dim
    audio_text = config.caption_channels if config.use_prompt_embeddings else config.audio_cross_attention_dim
    timestep = torch.full((batch,), 500.0, device=device)
    return dict(hidden_states=new(batch, frames * h * w, config.in_channels),
                audio_hidden_states=new(batch, audio, config.audio_in_channels),
                encoder_hidden_states=new(batch, length, video_text),
                audio_encoder_hidden_states=new(batch, length, audio_text), timestep=timestep, sigma=timestep,
                encoder_attention_mask=torch.ones(batch, length, device=device),
                audio_encoder_attention_mask=torch.ones(batch, length, device=device), num_frames=frames, height=h,
                width=w, fps=24.0, audio_num_frames=audio, use_cross_timestep=True, return_dict=False)


SPEC = FamilySpec(
    name="ltx2", policy=LTX2Policy, pipelines=("LTX2Pipeline",), transformers=("LTX2VideoTransformer3DModel",),
    lora_targets=tuple(DEFAULT_LORA_TARGETS),
    # the pipeline's __call__ defaults: 512 x 768, 121 frames (5 s at 24 fps), 30 steps, CFG 3, 1024 text tokens
    size={"height": 512, "width": 768, "num_frames": 121, "max_sequence_length": 1024}, num_steps=30, guidance=3.0,
    cfg="cfg", transformer_inputs=transformer_inputs, tiny={"ltx2": "pipelines.tiny_twins.ltx2"},
    architectures=("ltx-2",),
)
