"""FLUX.2 (dev and [klein]) as a :class:`flowalign.protocols.FlowPolicy`.

Wraps diffusers' ``Flux2Pipeline`` (dev: Mistral-Small-3.1 text features, guidance-distilled) or
``Flux2KleinPipeline`` (klein: Qwen3 text features; base with CFG, distilled without) as their ``__call__``
uses them: ``Flux2Transformer2DModel`` over packed tokens, ``AutoencoderKLFlux2``, and the scheduler's
exponential dynamic shift with FLUX.2's empirical ``mu`` (a function of token count *and* step count).

* Text: the stacked hidden states of three encoder layers (``text_encoder_out_layers``; dev 10/20/30,
  klein 9/18/27), padded to ``max_sequence_length``; token ids rebuilt per forward (all 4-axis, ``l`` = index).
* Latents: the VAE's 2×2-patchified, batch-normalised latents as tokens ``(B, (h/2)·(w/2), 4·C)``
  (C = 32, f = 8 for the releases); :meth:`Flux2Policy.to_vae_latents` undoes the normalisation and the
  patchify exactly as the pipeline before decoding (its ``output_type="latent"`` output).
* Guidance: dev takes the scale as an *embedding* (one pass, no negative; guidance distillation); klein base
  runs CFG against the empty prompt when ``guidance > 1``; distilled klein takes no guidance.
* Reference images (editing): both pipelines take ``image=[...]``, and so does :meth:`Flux2Policy.encode`
  (``images=``, one image or a list of them per prompt). Each is prepared as the pipeline prepares it (area
  capped at 1024² by Lanczos, sides floored to multiples of 2·f, centre-cropped), VAE-encoded (posterior
  mode), patchified, batch-normalised and packed; its tokens follow the noisy ones with position ids whose
  time axis is ``10·(i+1)`` for the ``i``-th reference; their output is dropped, and CFG's negative sees the
  same references. The text encoders never see the images. Rollouts pass each prompt's ``metadata["image"]``
  when ``defaults["reference_images"]`` (references per prompt, 0 by default: text-to-image) is set. The
  pipeline also refuses references under 64 px a side or beyond 8:1; this policy takes them (tiny models
  edit 32 px images).
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any

import diffusers
import numpy as np
import torch
from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu
from PIL import Image

from flowalign.errors import UserError
from flowalign.families import FamilySpec
from flowalign.protocols import Conditioning
from flowalign.sampling.inputs import load_input_image
from pipelines import lora as lora_utils
from pipelines._common import SAMPLING_KEYS
from pipelines._common import JOINT_ATTENTION_LORA_TARGETS, PolicyOptions, PromptCache, batch_size, check_num_steps
from pipelines._common import check_prompts, decode_in_chunks, encode_with_empty_negative, gaussian_noise
from pipelines._common import held, load_frozen_pipeline, make_trainable, own_scheduler, scheduler_shift, sigma_batch
from pipelines._common import sized_defaults, zeros_factory

#: LoRA targets when ``lora`` gives none: the double-stream attention projections (image and text) and the
#: single-stream blocks' fused QKV+MLP input projection, as in diffusers' FLUX.2 LoRA training script.
DEFAULT_LORA_TARGETS = [*JOINT_ATTENTION_LORA_TARGETS, "to_qkv_mlp_proj"]
PIPELINES = ("Flux2Pipeline", "Flux2KleinPipeline")
#: the most reference images a prompt may carry: a bound of this policy (BFL announce up to 10 for FLUX.2)
MAX_REFERENCES = 10
#: the pipelines' reference area cap (pixels): larger references are resized down to it at their aspect ratio
REFERENCE_AREA = 1024 * 1024


class Flux2Policy(lora_utils.AdapterMethods):
    """FLUX.2 text-to-image policy (see :class:`flowalign.protocols.FlowPolicy`).

    ``Conditioning.tensors``: ``prompt_embeds (B, L, 3·D_text)`` and, for klein base with
    ``defaults["guidance_scale"] > 1``, ``negative_prompt_embeds`` of the empty prompt; with reference images,
    ``image_latents (B, seq_r, 4·C)`` (every reference's packed tokens, in order) and ``image_ids (B, seq_r, 4)``.
    """

    family = "flux2"
    #: the model.defaults keys it reads
    sampling_keys: frozenset[str] = SAMPLING_KEYS | {"reference_images", "text_encoder_out_layers"}
    is_video = False

    def __init__(self, path: str | Path, **options: Any) -> None:
        """``options``: :class:`pipelines._common.PolicyOptions` (device, dtype, lora, full_finetune, ...)."""
        self.options = opts = PolicyOptions.parse(options)
        self.device, self.dtype = torch.device(opts.device), opts.dtype
        class_name = json.loads((Path(path) / "model_index.json").read_text())["_class_name"]
        if class_name not in PIPELINES:
            raise UserError(f"{path}: {class_name} is not a FLUX.2 pipeline ({', '.join(PIPELINES)})")
        self.pipeline_class = getattr(diffusers, class_name)
        self.pipe = load_frozen_pipeline(self.pipeline_class, path, opts)
        self.transformer = self.pipe.transformer
        self.vae = self.pipe.vae
        self.vae_scale_factor = self.pipe.vae_scale_factor
        self.guidance_embeds = bool(self.transformer.config.guidance_embeds)
        self.distilled = bool(self.pipe.config.get("is_distilled", False))
        layers = inspect.signature(self.pipe.encode_prompt).parameters["text_encoder_out_layers"].default
        # model cards: dev 50 steps at embedded guidance 4; klein base 50 steps CFG 4; distilled klein 4 steps
        side = self.pipe.default_sample_size * self.vae_scale_factor
        builtin = {
            "height": side, "width": side, "num_frames": None,
            "guidance_scale": 1.0 if self.distilled else 4.0, "num_steps": 4 if self.distilled else 50,
            "max_sequence_length": 512, "text_encoder_out_layers": list(layers),
            "shift": scheduler_shift(self.pipe), "reference_images": 0,
        }
        multiple = self.vae_scale_factor * 2  # 2×2 latent patches
        self.defaults: dict[str, Any] = sized_defaults(builtin, path, opts.defaults, multiple, "this FLUX.2 model")
        references = self.defaults["reference_images"]
        if isinstance(references, bool) or not isinstance(references, int) or not 0 <= references <= MAX_REFERENCES:
            raise UserError(f"model.defaults.reference_images={references!r}: give the number of reference images "
                            f"each prompt carries, an integer from 0 (text-to-image) to {MAX_REFERENCES}")
        self.scheduler = own_scheduler(self.pipe, self.defaults["shift"])
        self.trainable: torch.nn.Module = make_trainable(self.transformer, opts, DEFAULT_LORA_TARGETS)
        self._cache = PromptCache(opts.prompt_cache_size)

    # ------------------------------------------------------------------ shapes

    @property
    def token_hw(self) -> tuple[int, int]:
        """Token grid ``(h/2, w/2)`` of one image."""
        f = self.vae_scale_factor * 2
        return int(self.defaults["height"]) // f, int(self.defaults["width"]) // f

    @property
    def latent_shape(self) -> tuple[int, int]:
        """Packed ``(seq, 4·C)`` of one sample."""
        h, w = self.token_hw
        return h * w, self.transformer.config.in_channels

    @property
    def cfg(self) -> bool:
        """True when this checkpoint guides by CFG (klein base), not by embedding or not at all."""
        return not self.guidance_embeds and not self.distilled

    @property
    def input_images(self) -> bool:
        """True when each prompt carries reference images (``defaults["reference_images"] > 0``): rollouts then
        pass each prompt's ``metadata["image"]`` to :meth:`encode` (see :mod:`flowalign.sampling.inputs`)."""
        return int(self.defaults["reference_images"]) > 0

    # ------------------------------------------------------------------ text and reference images

    def encode(self, prompts: list[str], images: list[Any] | None = None) -> Conditioning:
        """Stacked text-encoder layers through the pipeline's ``encode_prompt``, cached per prompt string; with
        ``images`` (one entry per prompt: an image or a list of them), the references' tokens and ids too."""
        prompts = check_prompts(prompts)
        cfg = self.cfg and float(self.defaults["guidance_scale"]) > 1
        cond = encode_with_empty_negative(self._cache, prompts, self._encode_batch, cfg)
        if images is None and not self.input_images:
            return cond
        if images is None or len(images) != len(prompts):
            raise UserError(f"FLUX.2 editing takes reference images per prompt: give one entry per prompt "
                            f"({len(prompts)} prompts, {0 if images is None else len(images)} image entries)")
        with torch.no_grad():
            encoded = [self.encode_references(self._reference_list(entry)) for entry in images]
        shapes = sorted({tuple(z.shape) for z, _ in encoded})
        if len(shapes) > 1:
            raise UserError("FLUX.2 editing: the reference images of one batch must give the same token count "
                            f"(same number and sizes of references; got token shapes {shapes})")
        return Conditioning({**cond.tensors, "image_latents": torch.cat([z for z, _ in encoded]),
                             "image_ids": torch.cat([ids for _, ids in encoded])}, cond.prompts)

    def _reference_list(self, entry: Any) -> list[Any]:
        """One prompt's references as a list, checked against ``defaults["reference_images"]`` when set."""
        refs = list(entry) if isinstance(entry, (list, tuple)) else [entry]
        wanted = int(self.defaults["reference_images"])
        if not refs or len(refs) > MAX_REFERENCES or (wanted and len(refs) != wanted):
            expect = wanted or f"1 to {MAX_REFERENCES}"
            raise UserError(f"FLUX.2 editing: a prompt carries {len(refs)} reference images, expected {expect} "
                            "(model.defaults.reference_images)")
        return refs

    def reference_pixels(self, source: Any) -> torch.Tensor:
        """One reference as the pipeline prepares it: ``(1, 3, H', W')`` in [-1, 1], its area capped at 1024²
        (Lanczos), its sides floored to multiples of 2·f and centre-cropped to them."""
        array = (load_input_image(source).permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)
        image = Image.fromarray(array)
        processor = self.pipe.image_processor
        if image.width * image.height > REFERENCE_AREA:
            image = processor._resize_to_target_area(image, REFERENCE_AREA)
        multiple = self.vae_scale_factor * 2
        width, height = (image.width // multiple) * multiple, (image.height // multiple) * multiple
        if not width or not height:
            raise UserError(f"FLUX.2 reference image of {image.width}×{image.height} px is smaller than one "
                            f"{multiple}-px patch: give a larger image")
        return processor.preprocess(image, height=height, width=width, resize_mode="crop")

    def _normalised_latents(self, pixels: torch.Tensor) -> torch.Tensor:
        """Pixels ``(1, 3, H, W)`` in [-1, 1] → the VAE's posterior mode, patchified and batch-normalised
        ``(1, 4·C, H/2f, W/2f)`` (the pipeline's ``_encode_vae_image``)."""
        return self._normalised_posterior(pixels)[0]

    def _normalised_posterior(self, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Pixels ``(1, 3, H, W)`` in [-1, 1] → the posterior's mode and standard deviation, patchified and
        batch-normalised, each ``(1, 4·C, H/2f, W/2f)``: a posterior sample normalises to ``mode + std·ξ``."""
        posterior = self.vae.encode(pixels.to(self.device, self.vae.dtype)).latent_dist
        z = self.pipeline_class._patchify_latents(posterior.mode())
        bn = self.vae.bn
        mean = bn.running_mean.view(1, -1, 1, 1).to(z.device, z.dtype)
        std = torch.sqrt(bn.running_var.view(1, -1, 1, 1) + self.vae.config.batch_norm_eps).to(z.device, z.dtype)
        return (z - mean) / std, self.pipeline_class._patchify_latents(posterior.std) / std

    @torch.no_grad()
    def encode_images(self, images: torch.Tensor) -> torch.Tensor:
        """Target images ``(B, 3, H, W)`` in [0, 1] at the output size → clean tokens ``x0 (B, seq, 4·C)``
        float32 (the inverse of :meth:`decode`), one at a time, for supervised fine-tuning."""
        return self.encode_posterior(images)[0]

    @torch.no_grad()
    def encode_posterior(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Target images as :meth:`encode_images` → the posterior's mode and standard deviation as clean tokens,
        each ``(B, seq, 4·C)`` float32: a posterior sample normalises and packs to ``mode + std·ξ``."""
        if images.ndim != 4 or tuple(images.shape[-2:]) != (int(self.defaults["height"]), int(self.defaults["width"])):
            raise UserError(f"encode_images: images of shape {tuple(images.shape)}, expected (B, 3, "
                            f"{self.defaults['height']}, {self.defaults['width']}) at the model's output size")
        pairs = [self._normalised_posterior(image[None] * 2 - 1) for image in images]
        pack = self.pipeline_class._pack_latents
        return (torch.cat([pack(mode).float() for mode, _ in pairs]), torch.cat([pack(std).float() for _, std in pairs]))

    def encode_references(self, sources: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """References → packed tokens ``(1, seq_r, 4·C)`` float32 and their position ids ``(1, seq_r, 4)``
        (``(10·(i+1), row, column, 0)`` for the ``i``-th), as the pipeline's ``prepare_image_latents``."""
        latents = [self._normalised_latents(self.reference_pixels(source)) for source in sources]
        ids = self.pipeline_class._prepare_image_ids(latents).to(self.device)
        tokens = torch.cat([self.pipeline_class._pack_latents(z) for z in latents], dim=1)
        return tokens.float(), ids

    def _encode_batch(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        embeds, _ = self.pipe.encode_prompt(
            prompt=prompts, device=self.device, max_sequence_length=int(self.defaults["max_sequence_length"]),
            text_encoder_out_layers=tuple(self.defaults["text_encoder_out_layers"]),
        )
        return {"prompt_embeds": embeds.to(self.dtype)}

    # ------------------------------------------------------------------ flow

    def initial_noise(self, n: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """Pure noise ``(n, seq, 4·C)`` float32, drawn ``(n, 4·C, h/2, w/2)`` and packed as ``prepare_latents``."""
        h, w = self.token_hw
        noise = gaussian_noise((n, self.transformer.config.in_channels, h, w), generator, self.device)
        return noise.flatten(2).permute(0, 2, 1)  # (n, C, h, w) → (n, h·w, C) tokens, as the pipeline packs

    def _forward(self, x: torch.Tensor, sigma: torch.Tensor, embeds: torch.Tensor, guidance: torch.Tensor | None,
                 references: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """One transformer pass over the noisy tokens (and the reference tokens after them, whose output is
        dropped): ``(B, seq, 4·C)`` float32."""
        h, w = self.token_hw
        b = x.shape[0]
        hidden = x.to(self.device, self.dtype)
        img_ids = held(self, "_image_ids", (b, h, w, self.device),
                       lambda: self.pipeline_class._prepare_latent_ids(x.new_empty(b, 1, h, w)).to(self.device))
        if references is not None:
            tokens, ids = references
            hidden = torch.cat([hidden, tokens.to(self.device, self.dtype)], dim=1)
            img_ids = torch.cat([img_ids, ids.to(self.device, img_ids.dtype)], dim=1)
        embeds = embeds.to(self.device, self.dtype)
        txt_ids = held(self, "_text_ids", (*embeds.shape[:2], self.device),
                       lambda: self.pipeline_class._prepare_text_ids(embeds).to(self.device))
        return self.transformer(
            hidden_states=hidden, timestep=sigma.to(self.dtype), guidance=guidance,
            encoder_hidden_states=embeds, txt_ids=txt_ids, img_ids=img_ids, return_dict=False,
        )[0][:, : x.shape[1]].float()

    def velocity(
        self, x: torch.Tensor, sigma: float | torch.Tensor, cond: Conditioning, guidance: float
    ) -> torch.Tensor:
        """``v(x, σ | c[, references])`` float32 ``(B, seq, 4·C)``: embedded guidance (dev), CFG by one batched
        pass (klein base, w > 1; the negative sees the same references) or neither (distilled klein, which
        refuses w > 1)."""
        b = batch_size(x, cond)
        if x.shape[1:] != torch.Size(self.latent_shape):
            raise ValueError(f"velocity: x is {tuple(x.shape)}, expected packed (B, {self.latent_shape})")
        s = sigma_batch(sigma, b, self.device)
        embeds = cond.tensors["prompt_embeds"]
        refs = (cond.tensors["image_latents"], cond.tensors["image_ids"]) if "image_latents" in cond.tensors else None
        if refs is None and self.input_images:
            raise UserError("FLUX.2 editing velocity needs cond from encode(prompts, images=...)")
        if self.guidance_embeds:
            return self._forward(x, s, embeds, torch.full((b,), float(guidance), device=self.device), refs)
        if self.distilled and guidance > 1:
            raise UserError(f"guidance={guidance}: this FLUX.2 klein checkpoint is distilled and takes no "
                            "guidance; use guidance_scale <= 1")
        if guidance <= 1:
            return self._forward(x, s, embeds, None, refs)
        if "negative_prompt_embeds" not in cond.tensors:
            raise UserError(f"guidance={guidance} needs CFG negatives, but cond was encoded with guidance_scale="
                            f"{self.defaults['guidance_scale']}: set defaults['guidance_scale'] > 1 before encode()")
        both = None if refs is None else (torch.cat([refs[0], refs[0]]), torch.cat([refs[1], refs[1]]))
        out = self._forward(torch.cat([x, x]), torch.cat([s, s]),
                            torch.cat([cond.tensors["negative_prompt_embeds"], embeds]), None, both)
        v_uncond, v_cond = out.chunk(2)
        return v_uncond + guidance * (v_cond - v_uncond)

    def sigmas(self, num_steps: int) -> torch.Tensor:
        """The scheduler's grid ``(num_steps+1,)`` float32, 1 → 0: ``linspace(1, 1/n, n)`` shifted with
        ``mu = compute_empirical_mu(tokens, n)``, as both FLUX.2 pipelines set it."""
        n = check_num_steps(num_steps)
        mu = compute_empirical_mu(image_seq_len=self.latent_shape[0], num_steps=n)
        self.scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / n, n), device="cpu", mu=mu)
        return self.scheduler.sigmas.to(torch.float32).clone()

    def to_vae_latents(self, x0: torch.Tensor) -> torch.Tensor:
        """Tokens ``(B, seq, 4·C)`` → the VAE's latents ``(B, C, h, w)``: batch-norm undone, 2×2 unpatchified
        (what the pipeline returns for ``output_type="latent"``)."""
        h, w = self.token_hw
        z = x0.to(self.device).float().permute(0, 2, 1).reshape(x0.shape[0], -1, h, w)
        bn = self.vae.bn
        mean = bn.running_mean.view(1, -1, 1, 1).float()
        std = torch.sqrt(bn.running_var.view(1, -1, 1, 1).float() + self.vae.config.batch_norm_eps)
        return self.pipeline_class._unpatchify_latents(z * std + mean)

    def decode(self, x0: torch.Tensor) -> torch.Tensor:
        """Tokens ``(B, seq, 4·C)`` → images ``(B, 3, H, W)`` float32 in [0, 1] (in chunks)."""
        return decode_in_chunks(self.vae, x0, self.options.decode_batch_size,
                                lambda chunk: self.to_vae_latents(chunk).to(self.vae.dtype))


def transformer_inputs(config: Any, batch: int, size: dict[str, Any], *, device: str | torch.device = "meta",
                       dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """The transformer's inputs as :meth:`Flux2Policy.velocity` passes them: tokens ``(B, (H/16)·(W/16), 4·C)``
    (followed by ``size["reference_images"]`` references' tokens, each counted at the output size), stacked text
    features ``(B, L, 3·D)``, 4-axis position ids, the guidance scale when embedded (dev)."""
    new = zeros_factory(device, dtype)
    images = 1 + int(size.get("reference_images") or 0)
    tokens = (int(size["height"]) // 16) * (int(size["width"]) // 16) * images
    text = int(size["max_sequence_length"])
    return dict(hidden_states=new(batch, tokens, config.in_channels), timestep=torch.full((batch,), 0.5, device=device),
                guidance=torch.full((batch,), 4.0, device=device) if config.guidance_embeds else None,
                encoder_hidden_states=new(batch, text, config.joint_attention_dim),
                txt_ids=new(batch, text, 4), img_ids=new(batch, tokens, 4), return_dict=False)


def guidance_kind(config: Any, index: dict[str, Any]) -> str:
    """dev embeds the scale; klein base runs CFG; the distilled klein (``is_distilled``) takes no guidance."""
    if config.guidance_embeds:
        return "embedded"
    return "none" if index.get("is_distilled", False) else "cfg"


SPEC = FamilySpec(
    name="flux2", policy=Flux2Policy, pipelines=PIPELINES, transformers=("Flux2Transformer2DModel",),
    lora_targets=tuple(DEFAULT_LORA_TARGETS),
    # the model cards: 1024², 50 steps at guidance 4 (embedded for dev, CFG for klein base, none for the
    # distilled klein, which Flux2Policy refuses to guide)
    size={"height": 1024, "width": 1024, "num_frames": None, "max_sequence_length": 512}, num_steps=50, guidance=4.0,
    cfg=guidance_kind, transformer_inputs=transformer_inputs,
    tiny={"flux2": "pipelines.tiny_twins.flux2", "flux2_dev": "pipelines.tiny_twins.flux2_dev"},
    architectures=("flux.2-dev", "flux.2-klein"),
)
