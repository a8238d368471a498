"""FLUX.1 (dev / schnell) as a :class:`flowalign.protocols.FlowPolicy`.

Wraps diffusers' ``FluxPipeline`` (``FluxTransformer2DModel`` with double- and single-stream blocks,
CLIP-L pooled + T5 sequence conditioning, ``AutoencoderKL``, ``FlowMatchEulerDiscreteScheduler`` with
resolution-dependent shift) exactly as the pipeline's ``__call__`` uses it.

Latents are *packed*: ``(B, (h/2)·(w/2), 4·C)`` tokens of 2×2 latent patches (h, w = H/f, W/f;
C = 16, f = 8 for FLUX.1), as the transformer consumes them; :meth:`FluxPolicy.decode` unpacks.

Guidance: FLUX.1-dev is guidance-distilled. It takes the guidance scale as an *embedding*
(``transformer.config.guidance_embeds``), one forward pass, no CFG and no negative prompt. FLUX.1-schnell
has no guidance input and takes none (``guidance`` ≤ 1 is required there).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from diffusers import FluxPipeline
from diffusers.pipelines.flux.pipeline_flux import calculate_shift

from flowalign.errors import UserError
from flowalign.families import FamilySpec
from flowalign.protocols import Conditioning
from pipelines import lora as lora_utils
from pipelines._common import SAMPLING_KEYS
from pipelines._common import JOINT_ATTENTION_LORA_TARGETS, PackedLatents, PromptCache, batch_size, check_num_steps
from pipelines._common import check_prompts, decode_in_chunks, gaussian_noise, grid_ids, make_trainable
from pipelines._common import open_pipeline, own_scheduler, pack_2x2, scheduler_shift, sigma_batch, sized_defaults
from pipelines._common import stack_rows, text_encoders, unpack_2x2, vae_unscale, zeros_factory

#: LoRA targets when ``lora`` gives none: the attention projections of the double-stream blocks (image
#: to_* and text add_* / to_add_out) and of the single-stream blocks (to_q/k/v), as diffusers' FLUX recipe.
DEFAULT_LORA_TARGETS = JOINT_ATTENTION_LORA_TARGETS


class FluxPolicy(PackedLatents, lora_utils.AdapterMethods):
    """FLUX.1 text-to-image policy (see :class:`flowalign.protocols.FlowPolicy`).

    ``Conditioning.tensors``: ``prompt_embeds (B, L, D)`` (T5) and ``pooled_prompt_embeds (B, P)`` (CLIP),
    in the model dtype on ``device``. No negatives: guidance goes through the guidance embedding.
    """

    family = "flux"
    #: the model.defaults keys it reads
    sampling_keys: frozenset[str] = SAMPLING_KEYS
    is_video = False
    #: the diffusers pipeline loaded (FLUX.1 Kontext's subclass swaps in ``FluxKontextPipeline``)
    pipeline_class: type = FluxPipeline

    def __init__(self, path: str | Path, **options: Any) -> None:
        """``options``: :class:`pipelines._common.PolicyOptions` (device, dtype, lora, full_finetune, ...)."""
        opts = open_pipeline(self, self.pipeline_class, path, options)
        self.guidance_embeds = bool(self.transformer.config.guidance_embeds)
        self._cache = PromptCache(opts.prompt_cache_size, text_encoders(self.pipe))

        # FLUX.1-dev (guidance embedding): 28 steps at guidance 3.5, T5 length 512; schnell: 4 steps, 256 tokens.
        self.vae_scale_factor = self.pipe.vae_scale_factor
        side = self.pipe.default_sample_size * self.vae_scale_factor
        dev = self.guidance_embeds
        builtin = {"height": side, "width": side, "num_frames": None, "guidance_scale": 3.5 if dev else 0.0,
                   "num_steps": 28 if dev else 4, "max_sequence_length": 512 if dev else 256,
                   "shift": scheduler_shift(self.pipe)}
        multiple = self.vae_scale_factor * 2  # 2×2 latent patches
        self.defaults: dict[str, Any] = sized_defaults(builtin, path, opts.defaults, multiple, "this FLUX model")

        # The policy's own scheduler copy; `shift` only matters when dynamic shifting is off (schnell).
        self.scheduler = own_scheduler(self.pipe, self.defaults["shift"])

        self.trainable: torch.nn.Module = make_trainable(self.transformer, opts, DEFAULT_LORA_TARGETS)

    # ------------------------------------------------------------------ text

    def encode(self, prompts: list[str]) -> Conditioning:
        """Prompt embeddings through the pipeline's own ``encode_prompt``, cached per prompt string."""
        prompts = check_prompts(prompts)
        rows = self._cache.lookup(prompts, self._encode_batch)
        return Conditioning(stack_rows(rows, prompts, ["prompt_embeds", "pooled_prompt_embeds"]), prompts)

    def _encode_batch(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        embeds, pooled, _ = self.pipe.encode_prompt(
            prompt=prompts,
            prompt_2=None,
            device=self.device,
            max_sequence_length=int(self.defaults["max_sequence_length"]),
        )
        # text_ids are all zeros (L, 3): rebuilt in velocity, nothing to cache
        return {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled}

    # ------------------------------------------------------------------ flow

    def initial_noise(self, n: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """Pure noise, packed ``(n, seq, 4·C)`` float32 on ``device``.

        Drawn unpacked ``(n, C, h, w)`` on the generator's device (CPU when None) and packed, exactly
        as ``FluxPipeline.prepare_latents``, so a seed gives the pipeline's latents.
        """
        h, w = self.latent_hw
        c = self.transformer.config.in_channels // 4
        return pack_2x2(gaussian_noise((n, c, h, w), generator, self.device))

    def velocity(
        self, x: torch.Tensor, sigma: float | torch.Tensor, cond: Conditioning, guidance: float
    ) -> torch.Tensor:
        """``v(x, σ | c)`` float32 ``(B, seq, 4·C)``, one forward pass.

        ``guidance`` feeds FLUX.1-dev's guidance embedding (no CFG). ``sigma``: a float or ``(B,)``.
        FLUX's transformer takes σ itself and multiplies by 1000 inside (the pipeline passes ``t/1000``),
        so the model sees ``timestep = 1000·σ`` like the other families.
        """
        b = batch_size(x, cond)
        if x.shape[1:] != torch.Size(self.latent_shape):
            raise ValueError(f"velocity: x is {tuple(x.shape)}, expected packed (B, {self.latent_shape})")
        if self.guidance_embeds:
            guidance_vec = torch.full((b,), float(guidance), device=self.device, dtype=torch.float32)
        elif guidance > 1:
            raise UserError(
                f"guidance={guidance}: this FLUX checkpoint has no guidance embedding (schnell-style, "
                "guidance-distilled) and takes no guidance; use guidance_scale <= 1"
            )
        else:
            guidance_vec = None
        embeds = cond.tensors["prompt_embeds"].to(self.device, self.dtype)
        h, w = self.latent_hw
        img_ids = grid_ids(self, h // 2, w // 2, self.device, self.dtype)
        txt_ids = torch.zeros(embeds.shape[1], 3, device=self.device, dtype=self.dtype)
        out = self.transformer(
            hidden_states=x.to(self.device, self.dtype),
            timestep=sigma_batch(sigma, b, self.device),
            guidance=guidance_vec,
            pooled_projections=cond.tensors["pooled_prompt_embeds"].to(self.device, self.dtype),
            encoder_hidden_states=embeds,
            txt_ids=txt_ids,
            img_ids=img_ids,
            return_dict=False,
        )[0]
        return out.float()

    def sigmas(self, num_steps: int) -> torch.Tensor:
        """The scheduler's grid ``(num_steps+1,)`` float32, 1 → 0, as ``FluxPipeline`` sets it.

        Same call as the pipeline: base sigmas ``linspace(1, 1/n, n)`` and ``mu`` from the image
        sequence length through diffusers' ``calculate_shift`` (used when the config has
        ``use_dynamic_shifting``, FLUX.1-dev; schnell's static config ignores it).
        """
        n = check_num_steps(num_steps)
        config = self.scheduler.config
        base = None if config.get("use_flow_sigmas", False) else np.linspace(1.0, 1 / n, n)
        mu = calculate_shift(
            self.latent_shape[0],
            config.get("base_image_seq_len", 256),
            config.get("max_image_seq_len", 4096),
            config.get("base_shift", 0.5),
            config.get("max_shift", 1.15),
        )
        if base is None:
            self.scheduler.set_timesteps(n, device="cpu", mu=mu)
        else:
            self.scheduler.set_timesteps(sigmas=base, device="cpu", mu=mu)
        return self.scheduler.sigmas.to(torch.float32).clone()

    def decode(self, x0: torch.Tensor) -> torch.Tensor:
        """Packed latents ``(B, seq, 4·C)`` → images ``(B, 3, H, W)`` float32 in [0, 1] (in chunks).

        Differentiable in ``x0``; wrap in ``torch.no_grad()`` when only the pixels are needed.
        """
        h, w = self.latent_hw
        return decode_in_chunks(self.vae, x0, self.options.decode_batch_size,
                                lambda chunk: vae_unscale(self.vae, unpack_2x2(chunk.to(self.device), h, w)))


def transformer_inputs(config: Any, batch: int, size: dict[str, Any], *, device: str | torch.device = "meta",
                       dtype: torch.dtype = torch.float32, context_images: int = 0) -> dict[str, Any]:
    """The transformer's inputs as :meth:`FluxPolicy.velocity` passes them: packed tokens ``(B, (H/16)·(W/16),
    4·C)`` (followed by ``context_images`` more images' tokens, FLUX.1 Kontext), T5 text ``(B, L, D)``, pooled
    CLIP ``(B, P)``, position ids, and the guidance embedding's scale when the checkpoint has one."""
    new = zeros_factory(device, dtype)
    tokens = (int(size["height"]) // 16) * (int(size["width"]) // 16) * (1 + context_images)
    text = int(size["max_sequence_length"])
    return dict(hidden_states=new(batch, tokens, config.in_channels), timestep=torch.full((batch,), 0.5, device=device),
                guidance=torch.full((batch,), 3.5, device=device) if config.guidance_embeds else None,
                pooled_projections=new(batch, config.pooled_projection_dim),
                encoder_hidden_states=new(batch, text, config.joint_attention_dim),
                txt_ids=new(text, 3), img_ids=new(tokens, 3), return_dict=False)


SPEC = FamilySpec(
    name="flux", policy=FluxPolicy, pipelines=("FluxPipeline",), transformers=("FluxTransformer2DModel",),
    lora_targets=tuple(DEFAULT_LORA_TARGETS),
    # FLUX.1-dev's model card: 1024², 28 steps at embedded guidance 3.5, T5 length 512
    size={"height": 1024, "width": 1024, "num_frames": None, "max_sequence_length": 512}, num_steps=28, guidance=3.5,
    cfg="embedded", transformer_inputs=transformer_inputs, tiny={"flux": "pipelines.tiny_twins.flux1"},
    architectures=("flux.1-dev",),
)
