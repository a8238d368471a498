"""FLUX.1 Kontext (image editing) as a :class:`flowalign.protocols.FlowPolicy`, on top of :class:`FluxPolicy`.

``FluxKontextPipeline`` is FLUX.1-dev's model fed, after the noisy target tokens, the packed VAE latents of the
input image (its *context*), with position ids whose first axis is 1 instead of 0; the transformer's output
for the context tokens is dropped. Text, guidance embedding (2.5 by default for Kontext-dev), σ grid (``mu``
from the *target* token count) and decoding are FLUX.1's.

The input image reaches :meth:`KontextPolicy.encode` as ``images=[...]`` (see
:mod:`flowalign.sampling.inputs`), is resized to the output size, encoded with the VAE's posterior mode
(as the pipeline's ``sample_mode="argmax"``), normalised ``(z - shift)·scale`` and packed; it is part of the
``Conditioning`` (``image_latents (B, seq, 4·C)``), so trainers slice and repeat it with the prompt.
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers import FluxKontextPipeline

from flowalign.errors import UserError
from flowalign.families import FamilySpec
from flowalign.protocols import Conditioning
from pipelines import flux
from pipelines._common import batch_size, grid_ids, pack_2x2, resize_input, sampling_defaults, sigma_batch
from pipelines._common import with_input_images
from pipelines.flux import FluxPolicy


class KontextPolicy(FluxPolicy):
    """FLUX.1 Kontext editing policy: ``encode(prompts, images)`` adds ``image_latents`` to the conditioning."""

    family = "kontext"
    pipeline_class = FluxKontextPipeline
    #: rollouts pass each prompt's ``metadata["image"]`` to :meth:`encode`
    input_images = True

    def __init__(self, path: Any, *, defaults: dict[str, Any] | None = None, **kw: Any) -> None:
        super().__init__(path, defaults=defaults, **kw)
        # FLUX.1-Kontext-dev's model card: guidance 2.5 (not FLUX.1-dev's 3.5) unless flowalign.json / caller say
        if "guidance_scale" not in {**sampling_defaults(path), **(defaults or {})}:
            self.defaults["guidance_scale"] = 2.5

    def encode(self, prompts: list[str], images: list[Any] | None = None) -> Conditioning:
        """Text as FLUX.1 plus ``image_latents (B, seq, 4·C)``, one input image per prompt."""
        return with_input_images(super().encode(prompts), images, self.encode_image, "image_latents",
                                 "FLUX.1 Kontext edits an input image: give one image")

    def encode_image(self, image: torch.Tensor) -> torch.Tensor:
        """One image ``(3, H, W)`` in [0, 1] → packed context latents ``(1, seq, 4·C)`` float32 at the output size."""
        return self.encode_posterior(image[None])[0]

    @torch.no_grad()
    def encode_images(self, images: torch.Tensor) -> torch.Tensor:
        """Target images ``(B, 3, H, W)`` in [0, 1] → clean tokens ``x0 (B, seq, 4·C)`` float32, one at a time
        (as :meth:`encode_image`: the posterior mode, normalised and packed), for supervised fine-tuning."""
        return self.encode_posterior(images)[0]

    @torch.no_grad()
    def encode_posterior(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Images ``(B, 3, H, W)`` in [0, 1], each resized to the output size → the VAE posterior's mode and
        standard deviation, normalised and packed, each ``(B, seq, 4·C)`` float32, one image at a time: a
        posterior sample normalises and packs to ``mode + std·ξ``, ξ ~ N(0, I) (packing permutes, the scale
        multiplies)."""
        scale, shift = self.vae.config.scaling_factor, self.vae.config.shift_factor
        modes, stds = [], []
        for image in images:
            image = resize_input(image, int(self.defaults["height"]), int(self.defaults["width"]))
            posterior = self.vae.encode((image[None] * 2 - 1).to(self.device, self.vae.dtype)).latent_dist
            modes.append(pack_2x2((posterior.mode().float() - shift) * scale))
            stds.append(pack_2x2(posterior.std.float() * scale))
        return torch.cat(modes), torch.cat(stds)

    def velocity(
        self, x: torch.Tensor, sigma: float | torch.Tensor, cond: Conditioning, guidance: float
    ) -> torch.Tensor:
        """``v(x, σ | c, image)`` float32 ``(B, seq, 4·C)``: target and context tokens in one sequence,
        the context's output dropped; guidance through the embedding as FLUX.1-dev."""
        b = batch_size(x, cond)
        if "image_latents" not in cond.tensors:
            raise UserError("FLUX.1 Kontext velocity needs cond from encode(prompts, images=...)")
        context = cond.tensors["image_latents"].to(self.device, self.dtype)
        h, w = self.latent_hw
        ids = grid_ids(self, h // 2, w // 2, self.device, self.dtype)
        context_ids = ids.clone()  # (a copy on the device: the held ids are shared)
        context_ids[..., 0] = 1  # the context image's first position axis, as the pipeline marks it
        embeds = cond.tensors["prompt_embeds"].to(self.device, self.dtype)
        guidance_vec = torch.full((b,), float(guidance), device=self.device) if self.guidance_embeds else None
        out = self.transformer(
            hidden_states=torch.cat([x.to(self.device, self.dtype), context], dim=1),
            timestep=sigma_batch(sigma, b, self.device), guidance=guidance_vec,
            pooled_projections=cond.tensors["pooled_prompt_embeds"].to(self.device, self.dtype),
            encoder_hidden_states=embeds, txt_ids=torch.zeros(embeds.shape[1], 3, device=self.device, dtype=self.dtype),
            img_ids=torch.cat([ids, context_ids], dim=0), return_dict=False,
        )[0]
        return out[:, : x.shape[1]].float()


def transformer_inputs(config: Any, batch: int, size: dict[str, Any], *, device: Any = "meta",
                       dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """FLUX.1's inputs with the input image's tokens after the noisy ones (:meth:`KontextPolicy.velocity`)."""
    return flux.transformer_inputs(config, batch, size, device=device, dtype=dtype, context_images=1)


SPEC = FamilySpec(
    name="kontext", policy=KontextPolicy, pipelines=("FluxKontextPipeline",), transformers=("FluxTransformer2DModel",),
    lora_targets=flux.SPEC.lora_targets,
    # FLUX.1-Kontext-dev's model card: 1024², 28 steps at embedded guidance 2.5
    size={"height": 1024, "width": 1024, "num_frames": None, "max_sequence_length": 512}, num_steps=28, guidance=2.5,
    cfg="embedded", transformer_inputs=transformer_inputs, tiny={"kontext": "pipelines.tiny_twins.kontext"},
    architectures=("flux.1-kontext",),
)
