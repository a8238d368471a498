"""Qwen-Image-Edit as a :class:`flowalign.protocols.FlowPolicy`, on top of :class:`QwenImagePolicy`.

``QwenImageEditPipeline`` conditions Qwen-Image twice on the input image, and so does this policy:

* the Qwen2.5-VL encoder reads the instruction *with the image* (its vision tower, through the pipeline's
  ``Qwen2VLProcessor`` and edit template), for the prompt and for the true-CFG negative alike;
* the image's VAE latents (normalised with ``latents_mean`` / ``latents_std``, packed 2×2) follow the noisy
  tokens in the sequence, with their own RoPE frame; their output is dropped.

As the pipeline, the input image is resized to ``edit_image_area`` pixels (1024² there) at its own aspect
ratio, sides rounded to 32, before both. A batch's input images must share an aspect ratio (their token
counts must match to be batched); text rows are padded to the batch's longest (they include the image tokens).

Pref-GRPO's Qwen-Image-Edit training (``train_qwen_image_edit.py`` and its embedding script) conditions
otherwise, and three sampling defaults give its form (the pipeline's is each one's default), beside Qwen-Image's
``cfg_rescale: false`` (their plain CFG) and ``negative_prompt: ""``:

* ``edit_image_size: output`` resizes the input image to the sample's own height × width (their
  ``VaeImageProcessor.preprocess(height=h, width=w)``) instead of the condition area;
* ``vl_image: vae_tensor`` hands the VL encoder the VAE's input tensor (in [−1, 1]) instead of the image, as
  their embedding script does; the VL processor rescales it by 1/255 once more, so the encoder reads a nearly
  uniform picture and the instruction is read almost without the image (the VAE tokens still carry it);
* ``negative_image: black`` reads the negative prompt with a black image of that size (their
  ``_build_blank_image``) instead of the input image.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import torch
from diffusers import QwenImageEditPipeline
from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_dimensions
from PIL import Image

from flowalign.errors import UserError
from flowalign.families import FamilySpec
from flowalign.protocols import Conditioning
from flowalign.sampling.inputs import load_input_image
from pipelines import qwen_image
from pipelines._common import check_choice, pack_2x2, vae_latent_stats
from pipelines._varlen import pad_rows
from pipelines.qwen_image import QwenImagePolicy, negative_prompt

#: the sampling defaults that switch between the pipeline's conditioning (first) and Pref-GRPO's (second)
EDIT_FORMS = {"edit_image_size": ("area", "output"), "vl_image": ("image", "vae_tensor"),
              "negative_image": ("source", "black")}


class QwenImageEditPolicy(QwenImagePolicy):
    """Qwen-Image-Edit: ``encode(prompts, images)``; ``Conditioning`` adds ``image_latents (B, seq_c, 4·C)`` and
    ``image_hw (B, 2)`` (the condition's unpacked latent size) to Qwen-Image's text tensors."""

    family = "qwen_image_edit"
    sampling_keys = QwenImagePolicy.sampling_keys | {"edit_image_area", *EDIT_FORMS}
    pipeline_class = QwenImageEditPipeline
    input_images = True

    def __init__(self, path: Any, **kw: Any) -> None:
        super().__init__(path, **kw)
        self.defaults.setdefault("edit_image_area", 1024 * 1024)  # the pipeline's fixed condition area
        for key, forms in EDIT_FORMS.items():
            self.defaults.setdefault(key, forms[0])
            check_choice(self.defaults, key, forms)
        self._pending: dict[str, tuple[str, Image.Image]] = {}

    def condition_image(self, source: Any) -> Image.Image:
        """The input image as the pipeline feeds it: RGB, resized to ``edit_image_area`` at its aspect ratio
        (``edit_image_size: output``: to the sample's height × width)."""
        pixels = (load_input_image(source).permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)
        image = Image.fromarray(pixels)
        if self.defaults["edit_image_size"] == "output":
            return self.pipe.image_processor.resize(image, int(self.defaults["height"]), int(self.defaults["width"]))
        width, height, _ = calculate_dimensions(int(self.defaults["edit_image_area"]), image.width / image.height)
        return self.pipe.image_processor.resize(image, height, width)

    def encode(self, prompts: list[str], images: list[Any] | None = None) -> Conditioning:
        """Text read with the image (cached per prompt and image) plus the image's packed latents."""
        if images is None or len(images) != len(prompts):
            raise UserError(f"Qwen-Image-Edit edits an input image: give one image per prompt ({len(prompts)} "
                            f"prompts, {0 if images is None else len(images)} images)")
        pictures = [self.condition_image(im) for im in images]
        if len({p.size for p in pictures}) > 1:
            raise UserError("Qwen-Image-Edit: the input images of one batch must share an aspect ratio "
                            f"(got sizes {sorted({p.size for p in pictures})})")
        keys = [self._key(p, pic) for p, pic in zip(prompts, pictures)]
        negative = negative_prompt(self.defaults)
        cfg = float(self.defaults["guidance_scale"]) > 1
        neg_keys = [self._key(negative, self._negative_image(pic)) for pic in pictures] if cfg else []
        rows = self._cache.lookup(keys + neg_keys, self._encode_keys)
        self._pending.clear()  # keys found in the cache were never encoded
        # the VL encoder's sequence holds the image's tokens too (over a thousand at 1024²), so rows are padded
        # to the batch's longest, prompts and negatives alike, not to max_sequence_length
        length = max(rows[k]["prompt_embeds"].shape[0] for k in keys + neg_keys)
        embeds, mask = pad_rows([rows[k]["prompt_embeds"] for k in keys], length)
        tensors = {"prompt_embeds": embeds, "prompt_embeds_mask": mask}
        if cfg:
            neg, neg_mask = pad_rows([rows[k]["prompt_embeds"] for k in neg_keys], length)
            tensors.update(negative_prompt_embeds=neg, negative_prompt_embeds_mask=neg_mask)
        with torch.no_grad():
            latents = [self._image_latents(pic) for pic in pictures]
        tensors["image_latents"] = torch.cat([z for z, _ in latents])
        tensors["image_hw"] = torch.tensor([hw for _, hw in latents], device=self.device)
        return Conditioning(tensors, list(prompts))

    def _key(self, prompt: str, picture: Image.Image) -> str:
        key = f"{prompt}\x00{hashlib.sha1(picture.tobytes()).hexdigest()}"
        self._pending[key] = (prompt, picture)
        return key

    def _negative_image(self, picture: Image.Image) -> Image.Image:
        """The image the negative prompt is read with: the input image, or a black one of its size."""
        if self.defaults["negative_image"] == "black":
            return Image.new("RGB", picture.size, (0, 0, 0))
        return picture

    def _encode_keys(self, keys: list[str]) -> dict[str, torch.Tensor]:
        prompt, picture = self._pending[keys[0]]
        image: Any = [picture]
        if self.defaults["vl_image"] == "vae_tensor":  # the (1, 3, H, W) VAE input in [-1, 1], in the VAE's dtype
            image = self.pipe.image_processor.preprocess(picture, picture.height, picture.width).to(
                self.device, self.vae.dtype)
        embeds, _ = self.pipe.encode_prompt(prompt=[prompt], image=image, device=self.device,
                                            max_sequence_length=int(self.defaults["max_sequence_length"]))
        return {"prompt_embeds": embeds.to(self.dtype)}

    def _image_latents(self, picture: Image.Image) -> tuple[torch.Tensor, tuple[int, int]]:
        """``(1, seq_c, 4·C)`` packed normalised latents of the condition image and their ``(h, w)``."""
        pixels = self.pipe.image_processor.preprocess(picture, picture.height, picture.width).unsqueeze(2)
        z = self.vae.encode(pixels.to(self.device, self.vae.dtype)).latent_dist.mode().float()
        mean, std = vae_latent_stats(self)
        z = (z - mean) / std
        h, w = z.shape[-2:]
        return pack_2x2(z), (h, w)

    def _context(self, cond: Conditioning) -> tuple[torch.Tensor, tuple[int, int]]:
        if "image_latents" not in cond.tensors:
            raise UserError("Qwen-Image-Edit velocity needs cond from encode(prompts, images=...)")
        h, w = cond.tensors["image_hw"][0].tolist()
        return cond.tensors["image_latents"], (int(h), int(w))


def transformer_inputs(config: Any, batch: int, size: dict[str, Any], *, device: Any = "meta",
                       dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """Qwen-Image's inputs with the input image's tokens after the noisy ones (at the output size; the
    pipeline's condition area is 1024², the default output size)."""
    return qwen_image.transformer_inputs(config, batch, size, device=device, dtype=dtype, context_images=1)


SPEC = FamilySpec(
    name="qwen_image_edit", policy=QwenImageEditPolicy, pipelines=("QwenImageEditPipeline",),
    transformers=qwen_image.SPEC.transformers, lora_targets=qwen_image.SPEC.lora_targets, size=qwen_image.SPEC.size,
    num_steps=50, guidance=4.0, cfg="true_cfg", transformer_inputs=transformer_inputs,
    tiny={"qwen_image_edit": "pipelines.tiny_twins.qwen_image_edit"}, architectures=("qwen-image-edit",),
    unified="pipelines.unified:unified",  # its text encoder, Qwen2.5-VL, also writes
)
