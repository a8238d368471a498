"""Wan 2.1 text-to-video as a :class:`flowalign.protocols.FlowPolicy`.

Wraps diffusers' ``WanPipeline`` (``WanTransformer3DModel``, UMT5 text encoder, causal 3D
``AutoencoderKLWan``) as the pipeline's ``__call__`` uses it: latents ``(B, C, F', H', W')`` with
``F' = (F-1)/f_t + 1``, ``H' = H/f_s`` (Wan 2.1: C = 16, f_t = 4, f_s = 8); timestep ``1000·σ``; CFG
``v_u + w(v_c - v_u)`` against the empty prompt; the VAE in float32 whatever the model dtype (as
diffusers' Wan examples load it: its causal 3D convs lose detail in bf16).

Scheduler: real Wan 2.1 checkpoints ship a ``UniPCMultistepScheduler`` with ``use_flow_sigmas=True``
and ``flow_shift`` (3.0 at 480p, 5.0 at 720p): a multistep solver over a rectified-flow σ grid. flowalign
steps with its own Euler / SDE math, so the policy takes only that *grid* from the checkpoint's scheduler
(``set_timesteps(n)`` on a copy, ``sigmas`` exactly as UniPC computes them, shift included). Two end
fixes: UniPC lowers σ_0 by 1e-6 (to keep its log finite) and, with ``final_sigmas_type="sigma_min"``,
ends above 0; the grid here starts at exactly 1 and ends at 0, per ``conventions.md``. ``pipe(...)`` with
that UniPC scheduler therefore visits the same σ's but takes higher-order steps between them.
Checkpoints (like the tiny ones) that ship a ``FlowMatchEulerDiscreteScheduler`` are used as
``WanPipeline`` uses them, so rollouts match ``pipe(...)`` step for step. [derived]
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler, WanPipeline
from diffusers.pipelines.flux.pipeline_flux import calculate_shift

from flowalign.errors import UserError
from flowalign.protocols import Conditioning
from pipelines import lora as lora_utils
from pipelines._common import SAMPLING_KEYS
from pipelines._common import ATTENTION_LORA_TARGETS, PromptCache, batch_size, cfg_batch, cfg_combine, cfg_mix
from pipelines._common import check_multiple, check_num_steps, check_prompts, decode_in_chunks
from pipelines._common import encode_with_empty_negative, gaussian_noise, make_trainable, merge_defaults
from pipelines._common import negative_conditioning, open_pipeline, sigma_batch, text_encoders, vae_latent_stats, zeros_factory

#: LoRA targets when ``lora`` gives none: the self- (attn1) and cross-attention (attn2) projections of
#: every Wan block, as in diffusers'/finetrainers' Wan LoRA recipes.
DEFAULT_LORA_TARGETS = ATTENTION_LORA_TARGETS


class WanPolicy(lora_utils.AdapterMethods):
    """Wan 2.1 text-to-video policy (see :class:`flowalign.protocols.FlowPolicy`).

    ``Conditioning.tensors``: ``prompt_embeds (B, L, D)`` (UMT5, zero past each prompt's length) and,
    when ``defaults["guidance_scale"] > 1``, ``negative_prompt_embeds`` of the empty prompt, in the model
    dtype on ``device``.
    """

    family = "wan"
    #: the model.defaults keys it reads
    sampling_keys: frozenset[str] = SAMPLING_KEYS
    is_video = True
    #: Wan 2.2-A14B's high/low-noise experts are handled by the subclass in ``pipelines/wan22.py``
    two_experts = False
    #: the diffusers pipeline loaded (image-to-video: ``WanImageToVideoPipeline``, ``pipelines/wan_i2v.py``)
    pipeline_class: type = WanPipeline

    def __init__(self, path: str | Path, **options: Any) -> None:
        """``options``: :class:`pipelines._common.PolicyOptions` (device, dtype, lora, full_finetune, ...);
        ``decode_batch_size`` defaults to 2 videos."""
        opts = open_pipeline(self, self.pipeline_class, path, options, float32_vae=AutoencoderKLWan,
                             decode_batch_size=2)
        if (self.pipe.transformer_2 is not None and not self.two_experts) or self.pipe.transformer is None:
            raise UserError(
                f"{path}: two-expert Wan 2.2 checkpoints (transformer_2) load as pipelines.wan22.Wan22Policy "
                "(pipelines.load picks it); WanPolicy takes a single-transformer Wan 2.1 / 2.2-TI2V folder"
            )
        self.transformer = self.pipe.transformer
        self.vae = self.pipe.vae
        self.scale_t = self.pipe.vae_scale_factor_temporal
        self.scale_s = self.pipe.vae_scale_factor_spatial

        config = self.pipe.scheduler.config
        if isinstance(self.pipe.scheduler, FlowMatchEulerDiscreteScheduler):
            shift_key = "shift"
        elif isinstance(self.pipe.scheduler, UniPCMultistepScheduler) and config.get("use_flow_sigmas", False):
            shift_key = "flow_shift"
        else:
            raise UserError(
                f"{path}: scheduler {type(self.pipe.scheduler).__name__} is not supported; Wan folders need "
                "FlowMatchEulerDiscreteScheduler or UniPCMultistepScheduler with use_flow_sigmas=True"
            )
        ckpt_shift = float(config.get(shift_key, 1.0))

        # Wan 2.1 T2V at 480p (the pipeline's defaults): 81 frames, 50 steps, CFG 5.0, UMT5 length 512.
        builtin = {"height": 480, "width": 832, "num_frames": 81, "guidance_scale": 5.0, "num_steps": 50,
                   "max_sequence_length": 512, "shift": ckpt_shift}
        self.defaults: dict[str, Any] = merge_defaults(builtin, path, opts.defaults)
        _, ph, pw = self.transformer.config.patch_size
        check_multiple(self.defaults, {"height": self.scale_s * ph, "width": self.scale_s * pw}, "this Wan model")
        if (int(self.defaults["num_frames"]) - 1) % self.scale_t:
            raise UserError(
                f"num_frames={self.defaults['num_frames']}: num_frames - 1 must be a multiple of {self.scale_t} "
                "(the VAE's temporal factor)"
            )

        # The policy's own copy of the checkpoint's scheduler (only its sigma grid is used, see above);
        # a `shift` in the defaults replaces the config's shift / flow_shift value.
        self.scheduler = type(self.pipe.scheduler).from_config(config, **{shift_key: float(self.defaults["shift"])})

        self.trainable: torch.nn.Module = make_trainable(self.transformer, opts, DEFAULT_LORA_TARGETS)
        self._cache = PromptCache(opts.prompt_cache_size, text_encoders(self.pipe))

    # ------------------------------------------------------------------ shapes

    @property
    def latent_shape(self) -> tuple[int, int, int, int]:
        """``(C, F', H', W')`` of one video at the default size."""
        return (
            self.transformer.config.in_channels,
            (int(self.defaults["num_frames"]) - 1) // self.scale_t + 1,
            int(self.defaults["height"]) // self.scale_s,
            int(self.defaults["width"]) // self.scale_s,
        )

    # ------------------------------------------------------------------ text

    def encode(self, prompts: list[str]) -> Conditioning:
        """UMT5 embeddings through the pipeline's own ``encode_prompt``, cached per prompt string.

        The CFG negative is the empty prompt (the pipeline's ``negative_prompt=None``), encoded once.
        """
        prompts = check_prompts(prompts)
        cfg = float(self.defaults["guidance_scale"]) > 1
        return encode_with_empty_negative(self._cache, prompts, self._encode_batch, cfg)

    def _encode_batch(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        embeds, _ = self.pipe.encode_prompt(
            prompt=prompts,
            do_classifier_free_guidance=False,
            max_sequence_length=int(self.defaults["max_sequence_length"]),
            device=self.device,
            dtype=self.dtype,
        )
        return {"prompt_embeds": embeds}

    # ------------------------------------------------------------------ flow

    def initial_noise(self, n: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """Pure noise ``(n, C, F', H', W')`` float32 on ``device``, drawn on the generator's device
        (CPU when None) like ``WanPipeline.prepare_latents``."""
        return gaussian_noise((n, *self.latent_shape), generator, self.device)

    def velocity(
        self, x: torch.Tensor, sigma: float | torch.Tensor, cond: Conditioning, guidance: float,
        *, uncond: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``v(x, σ | c)`` float32 ``(B, C, F', H', W')``; CFG by one batched [uncond; cond] pass when w > 1,
        or by the conditional pass alone given ``uncond`` (:meth:`unconditional_velocity`, see
        :func:`pipelines._common.cfg_mix`).

        ``sigma``: a float or ``(B,)``; ``timestep = 1000·σ`` (per token for Wan 2.2-TI2V's
        ``expand_timesteps``, where every token of a text-to-video sample has the same σ).
        """
        b = batch_size(x, cond)
        if uncond is not None and guidance > 1:  # only the conditional half runs (and carries gradients)
            return cfg_mix(uncond, self.velocity(x, sigma, cond, 1.0), guidance)
        timestep = sigma_batch(sigma, b, self.device) * 1000.0
        if self.pipe.config.get("expand_timesteps", False):
            pt, ph, pw = self.transformer.config.patch_size
            tokens = (x.shape[2] // pt) * (x.shape[3] // ph) * (x.shape[4] // pw)
            timestep = timestep[:, None].expand(b, tokens)
        hidden = x.to(self.device, self.dtype)
        cfg = guidance > 1
        if cfg:  # the pipeline runs cond and uncond as two passes; one batched pass gives the same values
            hidden, timestep = torch.cat([hidden, hidden]), torch.cat([timestep, timestep])
            (embeds,) = cfg_batch(cond, ["prompt_embeds"], self.defaults["guidance_scale"], self.device, self.dtype)
        else:
            embeds = cond.tensors["prompt_embeds"].to(self.device, self.dtype)
        out = self.transformer(
            hidden_states=hidden, timestep=timestep, encoder_hidden_states=embeds, return_dict=False
        )[0]
        return cfg_combine(out, guidance) if cfg else out.float()

    def unconditional_velocity(self, x: torch.Tensor, sigma: float | torch.Tensor, cond: Conditioning) -> torch.Tensor:
        """The CFG negative's velocity ``v_u`` float32 (one forward of batch B), for ``velocity(..., uncond=v_u)``."""
        negatives = negative_conditioning(cond, ["prompt_embeds"], self.defaults["guidance_scale"])
        return self.velocity(x, sigma, negatives, 1.0)

    def sigmas(self, num_steps: int) -> torch.Tensor:
        """The checkpoint scheduler's grid ``(num_steps+1,)`` float32, 1 → 0, shift included.

        ``set_timesteps(n)`` as ``WanPipeline`` calls it (Euler or UniPC-with-flow-sigmas, see the module
        docstring). A config with ``use_dynamic_shifting`` (no released Wan has one) gets ``mu`` from the
        video token count through diffusers' ``calculate_shift``, as FLUX does for images. [derived]
        """
        n = check_num_steps(num_steps)
        kwargs = {}
        config = self.scheduler.config
        if config.get("use_dynamic_shifting", False):
            _, f, h, w = self.latent_shape
            pt, ph, pw = self.transformer.config.patch_size
            kwargs["mu"] = calculate_shift(
                (f // pt) * (h // ph) * (w // pw),
                config.get("base_image_seq_len", 256),
                config.get("max_image_seq_len", 4096),
                config.get("base_shift", 0.5),
                config.get("max_shift", 1.15),
            )
        self.scheduler.set_timesteps(n, device="cpu", **kwargs)
        grid = self.scheduler.sigmas.to(torch.float32).clone()
        if isinstance(self.scheduler, UniPCMultistepScheduler):
            grid[0], grid[-1] = 1.0, 0.0  # UniPC's σ_0 = 1 - 1e-6 and optional σ_min end, see above
        return grid

    def decode(self, x0: torch.Tensor) -> torch.Tensor:
        """Latents ``(B, C, F', H', W')`` → videos ``(B, F, 3, H, W)`` float32 in [0, 1] (in chunks).

        De-normalises with the VAE's ``latents_mean`` / ``latents_std`` as ``WanPipeline`` does.
        Differentiable in ``x0``; wrap in ``torch.no_grad()`` when only the pixels are needed.
        """
        mean, std = vae_latent_stats(self)  # copied to the device once, not at every decode
        videos = decode_in_chunks(self.vae, x0, self.options.decode_batch_size,
                                  lambda chunk: (chunk.to(self.device, torch.float32) * std + mean).to(self.vae.dtype))
        return videos.permute(0, 2, 1, 3, 4).contiguous()  # (B, 3, F, H, W) → (B, F, 3, H, W)


def transformer_inputs(config: Any, batch: int, size: dict[str, Any], *, device: str | torch.device = "meta",
                       dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """One expert's inputs as :meth:`WanPolicy.velocity` passes them: video latents ``(B, C, 1 + (F-1)/4, H/8,
    W/8)`` (image-to-video: the first-frame condition's channels included in ``in_channels``), UMT5 text
    ``(B, L, D)``. ``size``'s optional ``vae_scale_temporal`` / ``vae_scale_spatial`` replace the released
    VAE's 4 and 8 (a tiny twin's VAE)."""
    new = zeros_factory(device, dtype)
    f_t, f_s = int(size.get("vae_scale_temporal") or 4), int(size.get("vae_scale_spatial") or 8)
    frames = 1 + (int(size["num_frames"] or 1) - 1) // f_t
    h, w = int(size["height"]) // f_s, int(size["width"]) // f_s
    return dict(hidden_states=new(batch, config.in_channels, frames, h, w),
                timestep=torch.full((batch,), 500.0, device=device),
                encoder_hidden_states=new(batch, int(size["max_sequence_length"]), config.text_dim), return_dict=False)
