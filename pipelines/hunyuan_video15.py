"""HunyuanVideo 1.5 text-to-video as a :class:`flowalign.protocols.FlowPolicy`.

Wraps diffusers' ``HunyuanVideo15Pipeline`` as its ``__call__`` uses it: latents ``(B, C, F', H', W')``
with ``F' = (F-1)/f_t + 1``, ``H' = H/f_s`` (the release: C = 32, f_t = 4, f_s = 16); the transformer reads
``[x; 0; 0]`` along channels (text-to-video: the first-frame condition and its mask are zeros), zero image
embeddings, the timestep ``1000·σ``, the Qwen2.5-VL prompt embeddings (the pipeline's system prompt, its
third hidden state from the end, 1000 tokens) with their mask, and the ByT5 embeddings of any quoted text
in the prompt (256 tokens; zeros when the prompt quotes none) with theirs. CFG ``v_u + w(v_c − v_u)``
against the empty prompt, with ``w`` the checkpoint's guider scale (the pipeline takes no
``guidance_scale`` argument). Sigma grid: ``linspace(1, 0, n+1)[:-1]`` through the checkpoint's
``FlowMatchEulerDiscreteScheduler`` (its shift), as the pipeline sets it. The VAE decodes in float32
(``z / scaling_factor``), one video at a time: diffusers' causal mid-block attention mask does not
broadcast over a batch of more than one.

The pipeline has no ``load_lora_weights``: a LoRA is written in the transformer's own model-level format,
which ``pipe.transformer.load_lora_adapter(folder, weight_name="pytorch_lora_weights.safetensors")`` loads (:func:`pipelines.lora.save_model_adapter`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from diffusers import AutoencoderKLHunyuanVideo15, FlowMatchEulerDiscreteScheduler, HunyuanVideo15Pipeline

from flowalign.errors import UserError
from flowalign.families import FamilySpec
from flowalign.protocols import Conditioning
from pipelines import lora as lora_utils
from pipelines._common import SAMPLING_KEYS
from pipelines._common import ATTENTION_LORA_TARGETS, PromptCache, batch_size, cfg_batch, cfg_combine, cfg_mix
from pipelines._common import check_multiple, check_num_steps, check_prompts, decode_in_chunks
from pipelines._common import encode_with_empty_negative, gaussian_noise, make_trainable, merge_defaults
from pipelines._common import negative_conditioning, open_pipeline, require_scheduler, sigma_batch, text_encoders
from pipelines._common import zeros_factory

#: the attention projections of every dual-stream block (video and text streams)
DEFAULT_LORA_TARGETS = [*ATTENTION_LORA_TARGETS, "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"]
#: the conditioning tensors, each with a ``negative_`` twin under CFG
KEYS = ["prompt_embeds", "prompt_embeds_mask", "prompt_embeds_2", "prompt_embeds_mask_2"]


class HunyuanVideo15Policy(lora_utils.AdapterMethods):
    """HunyuanVideo 1.5 text-to-video policy (see :class:`flowalign.protocols.FlowPolicy`).

    ``Conditioning.tensors``: ``prompt_embeds (B, 1000, D)`` and ``prompt_embeds_mask (B, 1000)`` (Qwen2.5-VL),
    ``prompt_embeds_2 (B, 256, D₂)`` and ``prompt_embeds_mask_2 (B, 256)`` (ByT5 glyphs) and, when
    ``guidance_scale > 1``, the empty prompt's as ``negative_*``.
    """

    family = "hunyuan_video15"
    #: the model.defaults keys it reads
    sampling_keys: frozenset[str] = SAMPLING_KEYS
    is_video = True

    def __init__(self, path: str | Path, **options: Any) -> None:
        """``options``: :class:`pipelines._common.PolicyOptions`; ``decode_batch_size`` is 1 (see above)."""
        opts = open_pipeline(self, HunyuanVideo15Pipeline, path, {**options, "decode_batch_size": 1},
                             float32_vae=AutoencoderKLHunyuanVideo15)
        require_scheduler(self.pipe, FlowMatchEulerDiscreteScheduler, path, "HunyuanVideo 1.5")
        self.scale_t, self.scale_s = self.pipe.vae_scale_factor_temporal, self.pipe.vae_scale_factor_spatial
        # the pipeline's own defaults: its 16:9 size at the transformer's target size, 121 frames, 50 steps,
        # the guider's scale; 1000 Qwen2.5-VL tokens (the pipeline's fixed length)
        height, width = self.pipe.video_processor.calculate_default_height_width(
            self.pipe.default_aspect_ratio[1], self.pipe.default_aspect_ratio[0], self.pipe.target_size)
        builtin = {"height": height, "width": width, "num_frames": 121, "num_steps": 50,
                   "guidance_scale": float(self.pipe.guider.guidance_scale),
                   "max_sequence_length": self.pipe.tokenizer_max_length,
                   "shift": float(self.pipe.scheduler.config.get("shift", 1.0))}
        self.defaults: dict[str, Any] = merge_defaults(builtin, path, opts.defaults)
        check_multiple(self.defaults, {"height": self.scale_s, "width": self.scale_s}, "this HunyuanVideo 1.5 model")
        if (int(self.defaults["num_frames"]) - 1) % self.scale_t:
            raise UserError(f"num_frames={self.defaults['num_frames']}: num_frames - 1 must be a multiple of "
                            f"{self.scale_t} (the VAE's temporal factor)")
        self.scheduler = FlowMatchEulerDiscreteScheduler.from_config(
            self.pipe.scheduler.config, shift=float(self.defaults["shift"]))
        self.trainable: torch.nn.Module = make_trainable(self.transformer, opts, DEFAULT_LORA_TARGETS)
        self._cache = PromptCache(opts.prompt_cache_size, text_encoders(self.pipe))

    # ------------------------------------------------------------------ shapes and text

    @property
    def latent_shape(self) -> tuple[int, int, int, int]:
        """``(C, F', H', W')`` of one video at the default size."""
        return (self.vae.config.latent_channels, (int(self.defaults["num_frames"]) - 1) // self.scale_t + 1,
                int(self.defaults["height"]) // self.scale_s, int(self.defaults["width"]) // self.scale_s)

    def encode(self, prompts: list[str]) -> Conditioning:
        """Both text encoders through the pipeline's own ``encode_prompt``, cached per prompt string; the CFG
        negative is the empty prompt (the pipeline's ``negative_prompt=None``), encoded once."""
        prompts = check_prompts(prompts)
        return encode_with_empty_negative(self._cache, prompts, self._encode_batch,
                                          float(self.defaults["guidance_scale"]) > 1, KEYS)

    def _encode_batch(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        out = self.pipe.encode_prompt(prompt=prompts, device=self.device, dtype=self.dtype, batch_size=len(prompts))
        return dict(zip(KEYS, out))

    # ------------------------------------------------------------------ flow

    def initial_noise(self, n: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """Pure noise ``(n, C, F', H', W')`` float32, drawn as ``prepare_latents`` draws it."""
        return gaussian_noise((n, *self.latent_shape), generator, self.device)

    def velocity(self, x: torch.Tensor, sigma: float | torch.Tensor, cond: Conditioning, guidance: float,
                 *, uncond: torch.Tensor | None = None) -> torch.Tensor:
        """``v(x, σ | c)`` float32 ``(B, C, F', H', W')``; CFG by one batched [uncond; cond] pass when w > 1, or
        by the conditional pass alone given ``uncond`` (:meth:`unconditional_velocity`)."""
        b = batch_size(x, cond)
        if uncond is not None and guidance > 1:
            return cfg_mix(uncond, self.velocity(x, sigma, cond, 1.0), guidance)
        timestep = sigma_batch(sigma, b, self.device) * 1000.0
        latents = x.to(self.device, self.dtype)
        # text-to-video: the first-frame condition latents and their mask are zeros (prepare_cond_latents_and_mask)
        zeros = latents.new_zeros(b, latents.shape[1] + 1, *latents.shape[2:])
        hidden = torch.cat([latents, zeros], dim=1)
        cfg = guidance > 1
        if cfg:
            hidden, timestep = torch.cat([hidden, hidden]), torch.cat([timestep, timestep])
            text = dict(zip(KEYS, cfg_batch(cond, KEYS, self.defaults["guidance_scale"], self.device, self.dtype)))
        else:
            text = {k: cond.tensors[k].to(self.device, self.dtype) for k in KEYS}
        image_embeds = hidden.new_zeros(hidden.shape[0], self.pipe.vision_num_semantic_tokens,
                                        self.transformer.config.image_embed_dim)
        out = self.transformer(
            hidden_states=hidden, image_embeds=image_embeds, timestep=timestep,
            encoder_hidden_states=text["prompt_embeds"], encoder_attention_mask=text["prompt_embeds_mask"],
            encoder_hidden_states_2=text["prompt_embeds_2"], encoder_attention_mask_2=text["prompt_embeds_mask_2"],
            return_dict=False,
        )[0]
        return cfg_combine(out, guidance) if cfg else out.float()

    def unconditional_velocity(self, x: torch.Tensor, sigma: float | torch.Tensor, cond: Conditioning) -> torch.Tensor:
        """The CFG negative's velocity ``v_u`` float32 (one forward of batch B)."""
        return self.velocity(x, sigma, negative_conditioning(cond, KEYS, self.defaults["guidance_scale"]), 1.0)

    def sigmas(self, num_steps: int) -> torch.Tensor:
        """``(num_steps+1,)`` float32, 1 → 0: ``linspace(1, 0, n+1)[:-1]`` shifted by the scheduler, as the
        pipeline calls ``set_timesteps(sigmas=...)``."""
        n = check_num_steps(num_steps)
        self.scheduler.set_timesteps(sigmas=np.linspace(1.0, 0.0, n + 1)[:-1], device="cpu")
        return self.scheduler.sigmas.to(torch.float32).clone()

    def decode(self, x0: torch.Tensor) -> torch.Tensor:
        """Latents ``(B, C, F', H', W')`` → videos ``(B, F, 3, H, W)`` float32 in [0, 1], one at a time;
        differentiable in ``x0``."""
        scale = self.vae.config.scaling_factor
        videos = decode_in_chunks(self.vae, x0, self.options.decode_batch_size,
                                  lambda chunk: chunk.to(self.device, torch.float32) / scale)
        return videos.permute(0, 2, 1, 3, 4).contiguous()

    # ------------------------------------------------------------------ adapters (model-level format)

    def save_adapter(self, directory: str | Path) -> None:
        """Write ``pytorch_lora_weights.safetensors`` that ``pipe.transformer.load_lora_adapter`` reads."""
        lora_utils.save_model_adapter(self.transformer, directory)

    def load_adapter(self, directory: str | Path) -> None:
        """Load a LoRA saved by :meth:`save_adapter` (or a trainer checkpoint folder holding one)."""
        if self.full_finetune:
            raise UserError("load_adapter: this policy fine-tunes full weights; load it with lora={...} or none")
        lora_utils.load_model_adapter(self.transformer, directory)


def transformer_inputs(config: Any, batch: int, size: dict[str, Any], *, device: str | torch.device = "meta",
                       dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """The inputs :meth:`HunyuanVideo15Policy.velocity` passes: ``[x; 0; 0]`` ``(B, 2C+1, 1+(F-1)/4, H/16, W/16)``,
    729 image-embedding slots, 1000 Qwen2.5-VL tokens and 256 ByT5 tokens with their masks."""
    new = zeros_factory(device, dtype)
    frames = 1 + (int(size["num_frames"] or 1) - 1) // 4
    h, w = int(size["height"]) // 16, int(size["width"]) // 16
    length = int(size["max_sequence_length"])
    return dict(hidden_states=new(batch, config.in_channels, frames, h, w),
                image_embeds=new(batch, 729, config.image_embed_dim),
                timestep=torch.full((batch,), 500.0, device=device),
                encoder_hidden_states=new(batch, length, config.text_embed_dim),
                encoder_attention_mask=torch.ones(batch, length, device=device),
                encoder_hidden_states_2=new(batch, 256, config.text_embed_2_dim),
                encoder_attention_mask_2=torch.ones(batch, 256, device=device), return_dict=False)


SPEC = FamilySpec(
    name="hunyuan_video15", policy=HunyuanVideo15Policy, pipelines=("HunyuanVideo15Pipeline",),
    transformers=("HunyuanVideo15Transformer3DModel",), lora_targets=tuple(DEFAULT_LORA_TARGETS),
    # 480p text-to-video: the pipeline's 16:9 default at target size 640 (480 x 848 after rounding to 16),
    # 121 frames, 50 steps, the released guider's CFG 6.0, 1000 text tokens
    size={"height": 480, "width": 848, "num_frames": 121, "max_sequence_length": 1000}, num_steps=50, guidance=6.0,
    cfg="cfg", transformer_inputs=transformer_inputs, tiny={"hunyuan_video15": "pipelines.tiny_twins.hunyuan_video15"},
    architectures=("hunyuan-video-1.5-480p",),
)
