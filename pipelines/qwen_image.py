"""Qwen-Image as a :class:`flowalign.protocols.FlowPolicy`.

Wraps diffusers' ``QwenImagePipeline`` (``QwenImageTransformer2DModel``: 60 MMDiT blocks over Qwen2.5-VL-7B
hidden states; the single-frame causal 3D ``AutoencoderKLQwenImage``; ``FlowMatchEulerDiscreteScheduler``
with exponential dynamic shift and ``shift_terminal``) as the pipeline's ``__call__`` uses it.

* Text: the VL encoder's last hidden state under Qwen-Image's system template, template tokens dropped,
  one row per prompt at its own length (no padding in the cache); batches are padded with a mask.
* Latents are packed 2×2 patches ``(B, (h/2)·(w/2), 4·C)`` (C = 16, f = 8), normalised per channel with
  the VAE's ``latents_mean`` / ``latents_std``; the transformer takes σ as its timestep.
* Guidance is *true* CFG against a negative prompt (``defaults["negative_prompt"]``, the model card's
  ``" "``) with Qwen-Image's norm rescale: ``v = ṽ·‖v_c‖/‖ṽ‖`` per token, ``ṽ = v_n + w(v_c - v_n)``,
  applied when ``guidance > 1`` (the pipeline's ``true_cfg_scale``). ``defaults["cfg_rescale"] = False`` keeps
  ``ṽ`` as it is: Pref-GRPO's Qwen-Image and Qwen-Image-Edit training scripts guide that way.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from diffusers import QwenImagePipeline
from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift

from flowalign.errors import UserError
from flowalign.families import FamilySpec
from flowalign.protocols import Conditioning
from pipelines import lora as lora_utils
from pipelines._common import SAMPLING_KEYS
from pipelines._common import JOINT_ATTENTION_LORA_TARGETS, PackedLatents, PromptCache, batch_size, check_choice
from pipelines._common import check_num_steps
from pipelines._common import check_prompts, decode_in_chunks, gaussian_noise, make_trainable, open_pipeline
from pipelines._common import own_scheduler, pack_2x2, scheduler_shift, sigma_batch, sized_defaults, unpack_2x2
from pipelines._common import vae_latent_stats, zeros_factory
from pipelines._varlen import pad_rows, trim

#: LoRA targets when ``lora`` gives none: the image (to_*) and text (add_* / to_add_out) attention
#: projections of every MMDiT block, as in diffusers' and DiffSynth's Qwen-Image LoRA recipes.
DEFAULT_LORA_TARGETS = JOINT_ATTENTION_LORA_TARGETS


def true_cfg(v_cond: torch.Tensor, v_neg: torch.Tensor, scale: float, rescale: bool = True) -> torch.Tensor:
    """Qwen-Image's true CFG ``(B, seq, D)``: the guided velocity rescaled to the conditional one's norm per token
    (``rescale``, the pipeline's), or left as it is."""
    guided = v_neg + scale * (v_cond - v_neg)
    if not rescale:
        return guided
    return guided * (v_cond.norm(dim=-1, keepdim=True) / guided.norm(dim=-1, keepdim=True))


def negative_prompt(defaults: dict[str, Any]) -> str:
    """The true-CFG negative prompt: ``defaults["negative_prompt"]`` as written (``""`` included), ``" "`` when
    unset (the model card's)."""
    negative = defaults.get("negative_prompt")
    return " " if negative is None else str(negative)


class QwenImagePolicy(PackedLatents, lora_utils.AdapterMethods):
    """Qwen-Image text-to-image policy (see :class:`flowalign.protocols.FlowPolicy`).

    ``Conditioning.tensors``: ``prompt_embeds (B, L, D)`` and ``prompt_embeds_mask (B, L)`` (``L`` =
    ``max_sequence_length``, zero-padded) and, when ``defaults["guidance_scale"] > 1``, the same two for the
    negative prompt (``negative_*``).
    """

    family = "qwen_image"
    #: the model.defaults keys it reads
    sampling_keys: frozenset[str] = SAMPLING_KEYS | {"negative_prompt", "cfg_rescale"}
    is_video = False
    pipeline_class: type = QwenImagePipeline

    def __init__(self, path: str | Path, **options: Any) -> None:
        """``options``: :class:`pipelines._common.PolicyOptions` (device, dtype, lora, full_finetune, ...)."""
        opts = open_pipeline(self, self.pipeline_class, path, options)
        self.vae_scale_factor = self.pipe.vae_scale_factor
        # Qwen-Image model card: true CFG 4.0 with negative prompt " ", 50 steps; the pipeline's 1024² default
        side = self.pipe.default_sample_size * self.vae_scale_factor
        builtin = {
            "height": side, "width": side, "num_frames": None, "guidance_scale": 4.0, "num_steps": 50,
            "max_sequence_length": 512, "negative_prompt": " ", "cfg_rescale": True,
            "shift": scheduler_shift(self.pipe),
        }
        multiple = self.vae_scale_factor * 2  # 2×2 latent patches
        self.defaults: dict[str, Any] = sized_defaults(builtin, path, opts.defaults, multiple, "this Qwen-Image model")
        check_choice(self.defaults, "cfg_rescale", (True, False))
        self.scheduler = own_scheduler(self.pipe, self.defaults["shift"])
        self.trainable: torch.nn.Module = make_trainable(self.transformer, opts, DEFAULT_LORA_TARGETS)
        self._cache = PromptCache(opts.prompt_cache_size)

    # ------------------------------------------------------------------ text

    def encode(self, prompts: list[str]) -> Conditioning:
        """Qwen2.5-VL embeddings through the pipeline's ``encode_prompt``, cached per prompt string."""
        prompts = check_prompts(prompts)
        negative = negative_prompt(self.defaults)
        cfg = float(self.defaults["guidance_scale"]) > 1
        rows = self._cache.lookup(prompts + [negative] if cfg else prompts, self._encode_batch)
        length = int(self.defaults["max_sequence_length"])
        embeds, mask = pad_rows([rows[p]["prompt_embeds"] for p in prompts], length)
        tensors = {"prompt_embeds": embeds, "prompt_embeds_mask": mask}
        if cfg:
            neg, neg_mask = pad_rows([rows[negative]["prompt_embeds"]] * len(prompts), length)
            tensors.update(negative_prompt_embeds=neg, negative_prompt_embeds_mask=neg_mask)
        return Conditioning(tensors, prompts)

    def _encode_batch(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        embeds, _ = self.pipe.encode_prompt(
            prompt=prompts, device=self.device, max_sequence_length=int(self.defaults["max_sequence_length"])
        )
        return {"prompt_embeds": embeds.to(self.dtype)}  # one prompt: no padding, mask all ones

    # ------------------------------------------------------------------ flow

    def initial_noise(self, n: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """Pure noise, packed ``(n, seq, 4·C)`` float32, drawn ``(n, 1, C, h, w)`` as ``prepare_latents``."""
        h, w = self.latent_hw
        c = self.transformer.config.in_channels // 4
        return pack_2x2(gaussian_noise((n, 1, c, h, w), generator, self.device))

    def _context(self, cond: Conditioning) -> tuple[torch.Tensor, tuple[int, int]] | None:
        """Extra image tokens after the noisy ones (Qwen-Image-Edit's input image); none for text-to-image."""
        return None

    def _forward(self, x: torch.Tensor, sigma: torch.Tensor, embeds: torch.Tensor, mask: torch.Tensor,
                 context: tuple[torch.Tensor, tuple[int, int]] | None = None) -> torch.Tensor:
        h, w = self.latent_hw
        # the lengths are read from the mask on the host (where the prompt cache keeps it): no wait for the GPU
        embeds, mask = trim(embeds, mask.cpu())
        embeds = embeds.to(self.device, self.dtype)
        mask = None if mask is None else mask.to(self.device, non_blocking=True)
        hidden, shapes = x.to(self.device, self.dtype), [(1, h // 2, w // 2)]
        if context is not None:  # the context's tokens ride along; their output is dropped
            hidden = torch.cat([hidden, context[0].to(self.device, self.dtype)], dim=1)
            shapes.append((1, context[1][0] // 2, context[1][1] // 2))
        out = self.transformer(
            hidden_states=hidden, timestep=sigma.to(self.dtype), guidance=None,
            encoder_hidden_states=embeds, encoder_hidden_states_mask=mask,
            img_shapes=[shapes] * x.shape[0], return_dict=False,
        )[0]
        return out[:, : x.shape[1]].float()

    def velocity(
        self, x: torch.Tensor, sigma: float | torch.Tensor, cond: Conditioning, guidance: float
    ) -> torch.Tensor:
        """``v(x, σ | c)`` float32 ``(B, seq, 4·C)``; true CFG (norm-rescaled unless ``cfg_rescale`` is false) by
        one batched pass when w > 1."""
        b = batch_size(x, cond)
        if x.shape[1:] != torch.Size(self.latent_shape):
            raise ValueError(f"velocity: x is {tuple(x.shape)}, expected packed (B, {self.latent_shape})")
        s = sigma_batch(sigma, b, self.device)
        embeds, mask = cond.tensors["prompt_embeds"], cond.tensors["prompt_embeds_mask"]
        context = self._context(cond)
        if guidance <= 1:
            return self._forward(x, s, embeds, mask, context)
        if "negative_prompt_embeds" not in cond.tensors:
            raise UserError(f"guidance={guidance} needs the negative prompt, but cond was encoded with guidance_scale="
                            f"{self.defaults['guidance_scale']}: set defaults['guidance_scale'] > 1 before encode()")
        out = self._forward(
            torch.cat([x, x]), torch.cat([s, s]), torch.cat([embeds, cond.tensors["negative_prompt_embeds"]]),
            torch.cat([mask, cond.tensors["negative_prompt_embeds_mask"]]),
            None if context is None else (torch.cat([context[0], context[0]]), context[1]),
        )
        v_cond, v_neg = out.chunk(2)
        return true_cfg(v_cond, v_neg, guidance, bool(self.defaults["cfg_rescale"]))

    def sigmas(self, num_steps: int) -> torch.Tensor:
        """The scheduler's grid ``(num_steps+1,)`` float32, 1 → 0, as ``QwenImagePipeline`` sets it:
        ``linspace(1, 1/n, n)`` through the exponential dynamic shift (``mu`` from the token count) and
        ``shift_terminal``."""
        n = check_num_steps(num_steps)
        config = self.scheduler.config
        mu = calculate_shift(self.latent_shape[0], config.get("base_image_seq_len", 256),
                             config.get("max_image_seq_len", 4096), config.get("base_shift", 0.5),
                             config.get("max_shift", 1.15))
        self.scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / n, n), device="cpu", mu=mu)
        grid = self.scheduler.sigmas.to(torch.float32).clone()
        if not torch.isfinite(grid).all():  # shift_terminal stretches a one-point grid by 0/0
            raise UserError(f"num_steps={n} gives no valid grid with this scheduler's shift_terminal: use >= 2 steps")
        return grid

    def decode(self, x0: torch.Tensor) -> torch.Tensor:
        """Packed latents ``(B, seq, 4·C)`` → images ``(B, 3, H, W)`` float32 in [0, 1] (in chunks)."""
        h, w = self.latent_hw
        mean, std = vae_latent_stats(self)  # copied to the device once, not at every decode

        def to_vae(chunk: torch.Tensor) -> torch.Tensor:  # one-frame video latents, de-normalised
            return (unpack_2x2(chunk.to(self.device), h, w)[:, :, None].float() * std + mean).to(self.vae.dtype)

        return decode_in_chunks(self.vae, x0, self.options.decode_batch_size, to_vae)[:, :, 0]


def transformer_inputs(config: Any, batch: int, size: dict[str, Any], *, device: str | torch.device = "meta",
                       dtype: torch.dtype = torch.float32, context_images: int = 0) -> dict[str, Any]:
    """The transformer's inputs as :meth:`QwenImagePolicy.velocity` passes them: packed tokens ``(B, (H/16)·(W/16),
    4·C)`` (followed by ``context_images`` more images' tokens, Qwen-Image-Edit), VL text ``(B, L, D)`` with its
    mask, and each sample's image shapes for the RoPE."""
    new = zeros_factory(device, dtype)
    grid = (1, int(size["height"]) // 16, int(size["width"]) // 16)
    tokens, text = grid[1] * grid[2] * (1 + context_images), int(size["max_sequence_length"])
    return dict(hidden_states=new(batch, tokens, config.in_channels), timestep=torch.full((batch,), 0.5, device=device),
                guidance=None, encoder_hidden_states=new(batch, text, config.joint_attention_dim),
                encoder_hidden_states_mask=torch.ones(batch, text, device=device, dtype=torch.long),
                img_shapes=[[grid] * (1 + context_images)] * batch, return_dict=False)


SPEC = FamilySpec(
    name="qwen_image", policy=QwenImagePolicy, pipelines=("QwenImagePipeline",),
    transformers=("QwenImageTransformer2DModel",), lora_targets=tuple(DEFAULT_LORA_TARGETS),
    # Qwen-Image's model card: true CFG 4.0 against the negative prompt " ", 50 steps; the pipeline's 1024²
    size={"height": 1024, "width": 1024, "num_frames": None, "max_sequence_length": 512}, num_steps=50, guidance=4.0,
    cfg="true_cfg", transformer_inputs=transformer_inputs, tiny={"qwen_image": "pipelines.tiny_twins.qwen_image"},
    architectures=("qwen-image",),
)
