"""Z-Image as a :class:`flowalign.protocols.FlowPolicy`.

Wraps diffusers' ``ZImagePipeline`` (``ZImageTransformer2DModel``: a *single-stream* DiT, image and caption
tokens concatenated through every block after separate refiner blocks; a ``Qwen3Model`` text encoder, its
second-to-last hidden state; the FLUX.1 ``AutoencoderKL``) as the pipeline's ``__call__`` uses it.

Three conventions differ from the other families and are translated here, so trainers see the usual ones:

* the transformer takes ``t = 1 - σ`` and predicts ``x0 - ε`` (the pipeline negates it): the velocity here is
  ``-output``;
* it takes lists (one ``(C, 1, h, w)`` latent and one ``(L_i, D)`` caption per sample, captions at their own
  lengths): captions are stored padded with a mask and cut back per sample;
* the pipeline's ``guidance_scale`` ``w`` means ``v_c + w(v_c - v_u)`` (CFG off at 0): flowalign's guidance
  ``g`` is the usual ``v_u + g(v_c - v_u)``, i.e. ``g = 1 + w`` (Z-Image-Turbo: ``w = 0`` → ``g = 1``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from diffusers import ZImagePipeline
from diffusers.pipelines.z_image.pipeline_z_image import calculate_shift, get_default_z_image_sigmas

from flowalign.errors import UserError
from flowalign.families import FamilySpec
from flowalign.protocols import Conditioning
from pipelines import lora as lora_utils
from pipelines._common import SAMPLING_KEYS
from pipelines._common import ATTENTION_LORA_TARGETS, PromptCache, batch_size, check_num_steps, check_prompts
from pipelines._common import decode_in_chunks, gaussian_noise, make_trainable, open_pipeline, own_scheduler
from pipelines._common import scheduler_shift, sigma_batch, sized_defaults, vae_unscale, zeros_factory
from pipelines._varlen import pad_rows, unpad

#: LoRA targets when ``lora`` gives none: the attention projections of every single-stream and refiner block
DEFAULT_LORA_TARGETS = ATTENTION_LORA_TARGETS


class ZImagePolicy(lora_utils.AdapterMethods):
    """Z-Image text-to-image policy (see :class:`flowalign.protocols.FlowPolicy`).

    ``Conditioning.tensors``: ``prompt_embeds (B, L, D)`` + ``prompt_embeds_mask (B, L)`` (``L`` =
    ``max_sequence_length``) and, when ``defaults["guidance_scale"] > 1``, the empty prompt's (``negative_*``).
    """

    family = "zimage"
    #: the model.defaults keys it reads
    sampling_keys: frozenset[str] = SAMPLING_KEYS
    is_video = False

    def __init__(self, path: str | Path, **options: Any) -> None:
        """``options``: :class:`pipelines._common.PolicyOptions` (device, dtype, lora, full_finetune, ...)."""
        opts = open_pipeline(self, ZImagePipeline, path, options)
        self.vae_scale_factor = self.pipe.vae_scale_factor
        # Z-Image-Turbo model card: 1024², 9 scheduler steps, guidance_scale 0 (g = 1, no CFG)
        builtin = {
            "height": 1024, "width": 1024, "num_frames": None, "guidance_scale": 1.0, "num_steps": 9,
            "max_sequence_length": 512, "shift": scheduler_shift(self.pipe),
        }
        multiple = self.vae_scale_factor * 2  # 2×2 latent patches
        self.defaults: dict[str, Any] = sized_defaults(builtin, path, opts.defaults, multiple, "this Z-Image model")
        self.scheduler = own_scheduler(self.pipe, self.defaults["shift"])
        self.trainable: torch.nn.Module = make_trainable(self.transformer, opts, DEFAULT_LORA_TARGETS)
        self._cache = PromptCache(opts.prompt_cache_size)

    @property
    def latent_shape(self) -> tuple[int, int, int]:
        """``(C, h, w)`` of one sample (h, w even, as the pipeline rounds them)."""
        f = self.vae_scale_factor * 2
        return (self.transformer.config.in_channels, 2 * (int(self.defaults["height"]) // f),
                2 * (int(self.defaults["width"]) // f))

    # ------------------------------------------------------------------ text

    def encode(self, prompts: list[str]) -> Conditioning:
        """Qwen3 caption features through the pipeline's ``encode_prompt``, cached per prompt string."""
        prompts = check_prompts(prompts)
        cfg = float(self.defaults["guidance_scale"]) > 1
        rows = self._cache.lookup(prompts + [""] if cfg else prompts, self._encode_batch)
        length = int(self.defaults["max_sequence_length"])
        embeds, mask = pad_rows([rows[p]["prompt_embeds"] for p in prompts], length)
        tensors = {"prompt_embeds": embeds, "prompt_embeds_mask": mask}
        if cfg:
            neg, neg_mask = pad_rows([rows[""]["prompt_embeds"]] * len(prompts), length)
            tensors.update(negative_prompt_embeds=neg, negative_prompt_embeds_mask=neg_mask)
        return Conditioning(tensors, prompts)

    def _encode_batch(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        embeds, _ = self.pipe.encode_prompt(  # the pipeline templates the list in place: pass a copy
            prompt=list(prompts), device=self.device, do_classifier_free_guidance=False,
            max_sequence_length=int(self.defaults["max_sequence_length"]),
        )
        return {"prompt_embeds": embeds[0][None].to(self.dtype)}

    # ------------------------------------------------------------------ flow

    def initial_noise(self, n: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """Pure noise ``(n, C, h, w)`` float32, drawn on the generator's device as ``prepare_latents``."""
        return gaussian_noise((n, *self.latent_shape), generator, self.device)

    def _forward(self, x: torch.Tensor, sigma: torch.Tensor, embeds: torch.Tensor, mask: torch.Tensor):
        latents = list(x.to(self.device, self.dtype).unsqueeze(2).unbind(0))
        # the lengths are read from the mask on the host (where the prompt cache keeps it): no wait for the GPU
        captions = unpad(embeds.to(self.device, self.dtype), mask.cpu())
        # its time as a keyword, so that a trainer's timestep form can read it (flowalign.sampling.timesteps)
        out = self.transformer(latents, t=(1 - sigma).to(self.dtype), cap_feats=captions, return_dict=False)[0]
        return -torch.stack([o.float() for o in out]).squeeze(2)  # the model predicts x0 - ε

    def velocity(
        self, x: torch.Tensor, sigma: float | torch.Tensor, cond: Conditioning, guidance: float
    ) -> torch.Tensor:
        """``v(x, σ | c)`` float32 ``(B, C, h, w)``; CFG ``v_u + g(v_c - v_u)`` in one list pass when g > 1."""
        b = batch_size(x, cond)
        s = sigma_batch(sigma, b, self.device)
        embeds, mask = cond.tensors["prompt_embeds"], cond.tensors["prompt_embeds_mask"]
        if guidance <= 1:
            return self._forward(x, s, embeds, mask)
        if "negative_prompt_embeds" not in cond.tensors:
            raise UserError(f"guidance={guidance} needs CFG negatives, but cond was encoded with guidance_scale="
                            f"{self.defaults['guidance_scale']}: set defaults['guidance_scale'] > 1 before encode()")
        out = self._forward(torch.cat([x, x]), torch.cat([s, s]),
                            torch.cat([embeds, cond.tensors["negative_prompt_embeds"]]),
                            torch.cat([mask, cond.tensors["negative_prompt_embeds_mask"]]))
        v_cond, v_uncond = out.chunk(2)
        return v_uncond + guidance * (v_cond - v_uncond)

    def sigmas(self, num_steps: int) -> torch.Tensor:
        """The scheduler's grid ``(num_steps+1,)`` float32, 1 → 0: Z-Image's default sigmas and ``mu`` as the
        pipeline passes them (``mu`` only acts under ``use_dynamic_shifting``; Turbo's static shift is 3)."""
        n = check_num_steps(num_steps)
        config = self.scheduler.config
        _, h, w = self.latent_shape
        mu = calculate_shift((h // 2) * (w // 2), config.get("base_image_seq_len", 256),
                             config.get("max_image_seq_len", 4096), config.get("base_shift", 0.5),
                             config.get("max_shift", 1.15))
        self.scheduler.set_timesteps(sigmas=get_default_z_image_sigmas(n), device="cpu", mu=mu)
        return self.scheduler.sigmas.to(torch.float32).clone()

    # Copied from pipelines.sd3.SD3Policy.decode
    def decode(self, x0: torch.Tensor) -> torch.Tensor:
        """Latents ``(B, C, h, w)`` → images ``(B, 3, H, W)`` float32 in [0, 1] (in chunks)."""
        return decode_in_chunks(self.vae, x0, self.options.decode_batch_size,
                                lambda chunk: vae_unscale(self.vae, chunk.to(self.device)))


def transformer_inputs(config: Any, batch: int, size: dict[str, Any], *, device: str | torch.device = "meta",
                       dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """The transformer's inputs as :meth:`ZImagePolicy.velocity` passes them: one ``(C, 1, H/8, W/8)`` latent and
    one ``(L, D)`` caption per sample, ``t = 1 - σ``."""
    new = zeros_factory(device, dtype)
    h, w = 2 * (int(size["height"]) // 16), 2 * (int(size["width"]) // 16)
    text = int(size["max_sequence_length"])
    return dict(x=[new(config.in_channels, 1, h, w) for _ in range(batch)], t=torch.full((batch,), 0.5, device=device),
                cap_feats=[new(text, config.cap_feat_dim) for _ in range(batch)], return_dict=False)


SPEC = FamilySpec(
    name="zimage", policy=ZImagePolicy, pipelines=("ZImagePipeline",), transformers=("ZImageTransformer2DModel",),
    lora_targets=tuple(DEFAULT_LORA_TARGETS),
    # Z-Image-Turbo's model card: 1024², 9 steps, no CFG
    size={"height": 1024, "width": 1024, "num_frames": None, "max_sequence_length": 512}, num_steps=9, guidance=1.0,
    cfg="cfg", transformer_inputs=transformer_inputs, tiny={"zimage": "pipelines.tiny_twins.zimage"},
    architectures=("z-image-turbo",),
)
