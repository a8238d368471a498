"""Wan 2.2 image-to-video (I2V-A14B) as a :class:`flowalign.protocols.FlowPolicy`, on top of :class:`Wan22Policy`.

``WanImageToVideoPipeline`` for Wan 2.2-I2V-A14B has no image encoder: the first frame conditions by channel
concatenation. The frame, followed by black frames, is VAE-encoded (posterior mode) and normalised; in front of
it go ``f_t`` mask channels (1 on the first frame's latent positions); the transformer sees
``[x, mask, frame latents]`` (``in_channels = C + f_t + C``). Experts, boundary (0.9 for I2V-A14B), CFG against the
empty prompt and decoding are :class:`Wan22Policy`'s. The condition is built by the pipeline's own
``prepare_latents`` and stored in the ``Conditioning`` as ``image_condition (B, f_t + C, F', H', W')``.
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers import WanImageToVideoPipeline

from flowalign.errors import UserError
from flowalign.protocols import Conditioning
from pipelines._common import negative_conditioning, resize_input, sigma_batch, with_input_images
from pipelines.wan22 import Wan22Policy


class WanI2VPolicy(Wan22Policy):
    """Wan 2.2 I2V-A14B: ``encode(prompts, images)`` adds the first-frame condition (see the module docstring)."""

    pipeline_class = WanImageToVideoPipeline
    #: rollouts pass each prompt's ``metadata["image"]`` (the first frame) to :meth:`encode`
    input_images = True

    def __init__(self, path: Any, **kw: Any) -> None:
        super().__init__(path, **kw)
        if self.transformer.config.image_dim is not None:
            raise UserError(f"{path}: Wan image-to-video with a CLIP image encoder (Wan 2.1 I2V) is not supported; "
                            "use a Wan 2.2 I2V-A14B folder")

    @property
    def latent_shape(self) -> tuple[int, int, int, int]:
        """``(C, F', H', W')`` of the sampled latent (the VAE's channels, not the transformer's input)."""
        c, f, h, w = super().latent_shape
        return self.vae.config.z_dim, f, h, w

    def encode(self, prompts: list[str], images: list[Any] | None = None) -> Conditioning:
        """UMT5 text as Wan plus ``image_condition``, one first frame per prompt."""
        return with_input_images(super().encode(prompts), images, self.frame_condition, "image_condition",
                                 "Wan image-to-video needs a first frame")

    def frame_condition(self, image: torch.Tensor) -> torch.Tensor:
        """One frame ``(3, H, W)`` in [0, 1] → ``(1, f_t + C, F', H', W')`` through the pipeline's ``prepare_latents``."""
        height, width = int(self.defaults["height"]), int(self.defaults["width"])
        image = resize_input(image, height, width)
        pixels = (image[None] * 2 - 1).to(self.device, torch.float32)
        zeros = torch.zeros((1, *self.latent_shape), device=self.device)  # passed as latents: no noise is drawn
        _, condition = self.pipe.prepare_latents(
            pixels, 1, self.vae.config.z_dim, height, width, int(self.defaults["num_frames"]), torch.float32,
            self.device, None, zeros,
        )
        return condition.float()

    def unconditional_velocity(self, x: torch.Tensor, sigma: float | torch.Tensor, cond: Conditioning) -> torch.Tensor:
        """The CFG negative's velocity float32: the negative prompt on the same first frame (the frame is not
        what CFG drops)."""
        negatives = negative_conditioning(cond, ["prompt_embeds"], self.defaults["guidance_scale"])
        if "image_condition" in cond.tensors:
            negatives.tensors["image_condition"] = cond.tensors["image_condition"]
        return self.velocity(x, sigma, negatives, 1.0)

    def expert_velocity(
        self, expert: torch.nn.Module, x: torch.Tensor, sigma: torch.Tensor, cond: Conditioning, guidance: float
    ) -> torch.Tensor:
        """The expert on ``[x, mask, frame latents]``; CFG ``v_u + w(v_c - v_u)`` by one batched pass when w > 1."""
        b = x.shape[0]
        if "image_condition" not in cond.tensors:
            raise UserError("Wan image-to-video velocity needs cond from encode(prompts, images=...)")
        hidden = torch.cat([x.to(self.device, self.dtype), cond.tensors["image_condition"].to(self.device, self.dtype)], 1)
        timestep = sigma_batch(sigma, b, self.device) * 1000.0
        embeds = cond.tensors["prompt_embeds"].to(self.device, self.dtype)
        cfg = guidance > 1
        if cfg:
            if "negative_prompt_embeds" not in cond.tensors:
                raise UserError(f"guidance={guidance} needs CFG negatives: set defaults['guidance_scale'] > 1 before encode()")
            hidden, timestep = torch.cat([hidden, hidden]), torch.cat([timestep, timestep])
            embeds = torch.cat([cond.tensors["negative_prompt_embeds"].to(self.device, self.dtype), embeds])
        out = expert(hidden_states=hidden, timestep=timestep, encoder_hidden_states=embeds, return_dict=False)[0].float()
        if cfg:
            v_uncond, v_cond = out.chunk(2)
            return v_uncond + guidance * (v_cond - v_uncond)
        return out
