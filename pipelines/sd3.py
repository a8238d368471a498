"""Stable Diffusion 3 / 3.5 as a :class:`flowalign.protocols.FlowPolicy`.

Wraps diffusers' ``StableDiffusion3Pipeline`` (MMDiT ``SD3Transformer2DModel``, CLIP-L + CLIP-G + T5
text encoders, ``AutoencoderKL``, ``FlowMatchEulerDiscreteScheduler``) exactly as the pipeline's own
``__call__`` uses it, so a rollout here reproduces ``pipe(..., output_type="latent")`` step for step.

Latents are ``(B, C, H/f, W/f)`` (C = 16 for SD3.5, f = VAE factor 8). The transformer output is the
rectified-flow velocity ``v = ε - x0`` in flowalign's convention: the scheduler's Euler step is
``x + (σ' - σ)·v``, the same sign as ``conventions.md``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from diffusers import StableDiffusion3Pipeline
from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import calculate_shift

from flowalign.errors import UserError
from flowalign.families import FamilySpec
from flowalign.protocols import Conditioning
from pipelines import lora as lora_utils
from pipelines._common import SAMPLING_KEYS
from pipelines._common import JOINT_ATTENTION_LORA_TARGETS, PromptCache, batch_size, cfg_batch, cfg_combine, cfg_mix
from pipelines._common import check_num_steps, check_prompts, decode_in_chunks, gaussian_noise, make_trainable
from pipelines._common import negative_conditioning, open_pipeline, own_scheduler, scheduler_shift, sigma_batch
from pipelines._common import sized_defaults, stack_rows, text_encoders, vae_unscale, zeros_factory

#: LoRA targets when ``lora`` gives none: every attention projection of the joint (MMDiT) blocks, image
#: stream (to_*) and text stream (add_* / to_add_out), as in Flow-GRPO's and diffusers' SD3 recipes.
DEFAULT_LORA_TARGETS = JOINT_ATTENTION_LORA_TARGETS


class SD3Policy(lora_utils.AdapterMethods):
    """SD3 / SD3.5 text-to-image policy (see :class:`flowalign.protocols.FlowPolicy`).

    ``Conditioning.tensors``: ``prompt_embeds (B, 77+L, D)``, ``pooled_prompt_embeds (B, P)`` and, when
    ``defaults["guidance_scale"] > 1``, ``negative_prompt_embeds`` / ``negative_pooled_prompt_embeds`` of
    the empty prompt (the pipeline's CFG negative), all in the model dtype on ``device``.
    """

    family = "sd3"
    #: the model.defaults keys it reads
    sampling_keys: frozenset[str] = SAMPLING_KEYS
    is_video = False
    #: the diffusers pipeline loaded (a family built on SD3 may subclass with its own)
    pipeline_class: type = StableDiffusion3Pipeline

    def __init__(self, path: str | Path, **options: Any) -> None:
        """``options``: :class:`pipelines._common.PolicyOptions` (device, dtype, lora, full_finetune, ...)."""
        opts = open_pipeline(self, self.pipeline_class, path, options)
        self._cache = PromptCache(opts.prompt_cache_size, text_encoders(self.pipe))

        # SD3.5-Medium's recommended settings (model card): 40 steps, CFG 4.5; T5 length as the pipeline.
        self.vae_scale_factor = self.pipe.vae_scale_factor
        side = self.pipe.default_sample_size * self.vae_scale_factor
        builtin = {"height": side, "width": side, "num_frames": None, "guidance_scale": 4.5, "num_steps": 40,
                   "max_sequence_length": 256, "shift": scheduler_shift(self.pipe)}
        multiple = self.vae_scale_factor * self.transformer.config.patch_size
        self.defaults: dict[str, Any] = sized_defaults(builtin, path, opts.defaults, multiple, "this SD3 model")

        # The policy's own scheduler (the pipeline keeps its own untouched); a `shift` in the defaults
        # is the scheduler's `shift` config value, not a re-derivation of the schedule.
        self.scheduler = own_scheduler(self.pipe, self.defaults["shift"])

        self.trainable: torch.nn.Module = make_trainable(self.transformer, opts, DEFAULT_LORA_TARGETS)

    # ------------------------------------------------------------------ shapes

    @property
    def latent_shape(self) -> tuple[int, int, int]:
        """``(C, H/f, W/f)`` of one sample at the default resolution."""
        f = self.vae_scale_factor
        return (
            self.transformer.config.in_channels,
            int(self.defaults["height"]) // f,
            int(self.defaults["width"]) // f,
        )

    # ------------------------------------------------------------------ text

    def encode(self, prompts: list[str]) -> Conditioning:
        """Prompt embeddings through the pipeline's own ``encode_prompt``, cached per prompt string.

        Tensors ``(B, ...)`` on ``device``. The CFG negative is the empty prompt's embedding (what the
        pipeline encodes for ``negative_prompt=None``), encoded once and repeated per sample.
        """
        prompts = check_prompts(prompts)
        cfg = float(self.defaults["guidance_scale"]) > 1
        rows = self._cache.lookup(prompts + [""] if cfg else prompts, self._encode_batch)
        keys = ["prompt_embeds", "pooled_prompt_embeds"]
        tensors = stack_rows(rows, prompts, keys)
        if cfg:
            negative = stack_rows(rows, [""] * len(prompts), keys)
            tensors.update({f"negative_{k}": v for k, v in negative.items()})
        return Conditioning(tensors, prompts)

    def _encode_batch(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        # do_classifier_free_guidance=False: negatives are encoded as the prompt "" (identical to the
        # pipeline's negative branch, which runs the same encoders on "" with clip_skip=None)
        embeds, _, pooled, _ = self.pipe.encode_prompt(
            prompt=prompts,
            prompt_2=None,
            prompt_3=None,
            device=self.device,
            do_classifier_free_guidance=False,
            max_sequence_length=int(self.defaults["max_sequence_length"]),
        )
        return {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled}

    # ------------------------------------------------------------------ flow

    def initial_noise(self, n: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """Pure noise ``(n, C, H/f, W/f)`` float32 on ``device``, drawn on the generator's device
        (CPU when None) as diffusers' ``randn_tensor`` does, so seeds match ``pipe(generator=...)``."""
        return gaussian_noise((n, *self.latent_shape), generator, self.device)

    def velocity(
        self, x: torch.Tensor, sigma: float | torch.Tensor, cond: Conditioning, guidance: float,
        *, uncond: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``v(x, σ | c)`` float32 ``(B, C, h, w)``; CFG ``v_u + w(v_c - v_u)`` by one batched pass when w > 1.

        ``sigma``: a float or a ``(B,)`` tensor; the transformer gets ``timestep = 1000·σ``.
        ``uncond``: a precomputed unconditional velocity (:meth:`unconditional_velocity`); only the
        conditional half then runs, see :func:`pipelines._common.cfg_mix`.
        """
        if guidance > 1:
            if uncond is not None:  # only the conditional half runs (and carries gradients)
                return cfg_mix(uncond, self.velocity(x, sigma, cond, 1.0), guidance)
            return self.velocity_and_unconditional(x, sigma, cond, guidance)[0]
        batch_size(x, cond)  # x and cond must agree
        out = self._transformer(x, sigma, [cond.tensors[k] for k in ("prompt_embeds", "pooled_prompt_embeds")])
        return out.float()

    def velocity_and_unconditional(
        self, x: torch.Tensor, sigma: float | torch.Tensor, cond: Conditioning, guidance: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """CFG's guided velocity ``v`` and its unconditional branch ``v_u``, float32 ``(B, C, h, w)`` each,
        from one forward of ``[uncond; cond]`` (2B rows) as the pipeline batches it."""
        embeds, pooled = cfg_batch(cond, ["prompt_embeds", "pooled_prompt_embeds"], self.defaults["guidance_scale"],
                                   self.device, self.dtype)
        sigmas = sigma_batch(sigma, batch_size(x, cond), self.device)
        out = self._transformer(torch.cat([x, x]), torch.cat([sigmas, sigmas]), [embeds, pooled])
        return cfg_combine(out, guidance), out.chunk(2)[0].float()

    def _transformer(self, x: torch.Tensor, sigma: float | torch.Tensor, text: list[torch.Tensor]) -> torch.Tensor:
        """The transformer's raw output ``(B, C, h, w)`` at ``timestep = 1000·σ`` for text ``[embeds, pooled]``."""
        timestep = sigma_batch(sigma, x.shape[0], self.device) * 1000.0
        embeds, pooled = (t.to(self.device, self.dtype) for t in text)
        return self.transformer(
            hidden_states=x.to(self.device, self.dtype),
            timestep=timestep,
            encoder_hidden_states=embeds,
            pooled_projections=pooled,
            return_dict=False,
        )[0]

    def unconditional_velocity(self, x: torch.Tensor, sigma: float | torch.Tensor, cond: Conditioning) -> torch.Tensor:
        """The CFG negative's velocity ``v_u`` float32 (one forward of batch B), for ``velocity(..., uncond=v_u)``."""
        negatives = negative_conditioning(cond, ["prompt_embeds", "pooled_prompt_embeds"], self.defaults["guidance_scale"])
        return self.velocity(x, sigma, negatives, 1.0)

    def sigmas(self, num_steps: int) -> torch.Tensor:
        """The scheduler's grid ``(num_steps+1,)`` float32, 1 → 0, with the model's shift.

        SD3.5 configs without dynamic shifting use the static ``shift``; a config with
        ``use_dynamic_shifting`` gets ``mu`` from the image sequence length as the pipeline computes it.
        """
        num_steps = check_num_steps(num_steps)
        kwargs = {}
        config = self.scheduler.config
        if config.get("use_dynamic_shifting", False):
            _, h, w = self.latent_shape
            p = self.transformer.config.patch_size
            kwargs["mu"] = calculate_shift(
                (h // p) * (w // p),
                config.get("base_image_seq_len", 256),
                config.get("max_image_seq_len", 4096),
                config.get("base_shift", 0.5),
                config.get("max_shift", 1.16),
            )
        self.scheduler.set_timesteps(int(num_steps), device="cpu", **kwargs)
        return self.scheduler.sigmas.to(torch.float32).clone()

    def decode(self, x0: torch.Tensor) -> torch.Tensor:
        """Latents ``(B, C, h, w)`` → images ``(B, 3, H, W)`` float32 in [0, 1] (in chunks).

        Differentiable in ``x0`` (the VAE is frozen, not detached); wrap in ``torch.no_grad()`` when
        only the pixels are needed.
        """
        return decode_in_chunks(self.vae, x0, self.options.decode_batch_size,
                                lambda chunk: vae_unscale(self.vae, chunk.to(self.device)))

    @torch.no_grad()
    def encode_images(self, images: torch.Tensor) -> torch.Tensor:
        """Images ``(B, 3, H, W)`` float in [0, 1] at the model's resolution → latents ``(B, C, h, w)`` float32.

        The inverse of :meth:`decode`: the VAE posterior *mean* (deterministic, so a pair's latent never
        depends on the batch or the RNG), normalised as the pipeline expects, ``x0 = (z - shift)·scale``.
        Encoded one image at a time: float kernels are not batch-invariant, and a latent that changed
        with its batch-mates would break bit-identical resume.
        """
        return self.encode_posterior(images)[0]

    @torch.no_grad()
    def encode_posterior(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Images ``(B, 3, H, W)`` in [0, 1] → the VAE posterior's mean and standard deviation, normalised,
        each ``(B, C, h, w)`` float32: a posterior sample ``z`` normalises to ``mean + std·ξ`` (``(z − shift)·scale``),
        ξ ~ N(0, I). Encoded one image at a time (see :meth:`encode_images`)."""
        if images.ndim != 4 or images.shape[1] != 3:
            raise UserError(f"encode_images expects images (B, 3, H, W), got shape {tuple(images.shape)}")
        size = (int(self.defaults["height"]), int(self.defaults["width"]))
        if tuple(images.shape[-2:]) != size:
            raise UserError(f"encode_images: images are {tuple(images.shape[-2:])} px but the model samples at "
                            f"{size}; resize them to height x width first")
        scale = self.vae.config.scaling_factor
        shift = self.vae.config.shift_factor or 0.0
        means, stds = [], []
        for image in images:
            x = (image[None].to(self.device, self.vae.dtype) * 2 - 1)
            posterior = self.vae.encode(x).latent_dist
            means.append((posterior.mean.float() - shift) * scale)
            stds.append(posterior.std.float() * scale)
        return torch.cat(means), torch.cat(stds)


def transformer_inputs(config: Any, batch: int, size: dict[str, Any], *, device: str | torch.device = "meta",
                       dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """The MMDiT's inputs as :meth:`SD3Policy.velocity` passes them: latents ``(B, C, H/f, W/f)``, CLIP + T5
    text ``(B, N + L, D)``, pooled CLIP ``(B, P)``. ``size``'s optional ``vae_scale_spatial`` (``f``) and
    ``clip_tokens`` (``N``), read from the folder's VAE and tokenizer configs, replace the released VAE's 8 and
    CLIP's 77 (a tiny twin's differ)."""
    new = zeros_factory(device, dtype)
    f, clip = int(size.get("vae_scale_spatial") or 8), int(size.get("clip_tokens") or 77)
    h, w = int(size["height"]) // f, int(size["width"]) // f
    return dict(hidden_states=new(batch, config.in_channels, h, w), timestep=torch.full((batch,), 500.0, device=device),
                encoder_hidden_states=new(batch, clip + int(size["max_sequence_length"]), config.joint_attention_dim),
                pooled_projections=new(batch, config.pooled_projection_dim), return_dict=False)


SPEC = FamilySpec(
    name="sd3", policy=SD3Policy, pipelines=("StableDiffusion3Pipeline",), transformers=("SD3Transformer2DModel",),
    lora_targets=tuple(DEFAULT_LORA_TARGETS),
    # SD3.5-Medium's model card: 1024², 40 steps, CFG 4.5; the pipeline's T5 length
    size={"height": 1024, "width": 1024, "num_frames": None, "max_sequence_length": 256}, num_steps=40, guidance=4.5,
    cfg="cfg", transformer_inputs=transformer_inputs, tiny={"sd3": "pipelines.tiny_twins.sd3"},
    architectures=("sd3.5-medium",),
)
