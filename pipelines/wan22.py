"""Wan 2.2-A14B (two experts) as a :class:`flowalign.protocols.FlowPolicy`, on top of :class:`WanPolicy`.

``WanPipeline`` with ``transformer_2`` and ``boundary_ratio`` in its config denoises with the high-noise
expert ``transformer`` while the timestep ``1000·σ`` is at or above ``boundary_ratio · num_train_timesteps``
and with the low-noise expert ``transformer_2`` below it (T2V-A14B: 0.875; I2V-A14B: 0.9). Everything else
(UMT5 text, 3D VAE, σ grid, CFG against the empty prompt) is Wan 2.1's, so this class only routes:

* :meth:`velocity` splits a batch by σ and runs each part through the expert that serves that σ, so a
  stored transition is always re-evaluated (and its log-prob trained) through the expert that sampled it;
* both experts are trainable (``trainable`` holds both), each with its own LoRA adapter;
* the low-noise expert uses ``defaults["guidance_scale_2"]`` when set (the pipeline's ``guidance_scale_2``;
  A14B's published 3.0 against 4.0), whenever CFG is on (``guidance > 1``);
* :meth:`save_adapter` writes the high-noise LoRA as ``pytorch_lora_weights.safetensors`` and the low-noise one
  as ``pytorch_lora_weights_transformer_2.safetensors``: diffusers loads the second with
  ``pipe.load_lora_weights(dir, weight_name=..., load_into_transformer_2=True)``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import torch
from diffusers import WanPipeline

from flowalign.errors import UserError
from flowalign.protocols import Conditioning
from pipelines import lora as lora_utils
from pipelines._common import cfg_mix, sigma_batch
from pipelines.wan_t2v import DEFAULT_LORA_TARGETS, WanPolicy

#: file of the low-noise expert's LoRA, next to the high-noise expert's ``pytorch_lora_weights.safetensors``
LORA_WEIGHT_NAME_2 = "pytorch_lora_weights_transformer_2.safetensors"


class Wan22Policy(WanPolicy):
    """Wan 2.2 two-expert text-to-video policy (``family == "wan"``; see the module docstring)."""

    sampling_keys = WanPolicy.sampling_keys | {"guidance_scale_2"}  # the low-noise expert's guidance

    two_experts = True

    def __init__(self, path: str | Path, *, lora: dict[str, Any] | None = None, full_finetune: bool = False,
                 gradient_checkpointing: bool = False, **kw: Any) -> None:
        super().__init__(path, lora=lora, full_finetune=full_finetune, gradient_checkpointing=gradient_checkpointing,
                         **kw)
        ratio = self.pipe.config.get("boundary_ratio")
        if self.pipe.transformer_2 is None or ratio is None:
            raise UserError(f"{path}: a two-expert Wan folder needs transformer_2 and boundary_ratio in model_index.json")
        self.transformer_2 = self.pipe.transformer_2
        self.boundary = float(ratio) * self.pipe.scheduler.config.num_train_timesteps
        lora_utils.setup_training(self.transformer_2, lora=lora, full_finetune=full_finetune,
                                  default_targets=DEFAULT_LORA_TARGETS, gradient_checkpointing=gradient_checkpointing)
        self.high_noise = self.transformer
        self.defaults.setdefault("guidance_scale_2", None)  # None: the high-noise expert's guidance for both
        #: both experts; parameter names are prefixed ``transformer.`` / ``transformer_2.``
        self.trainable = torch.nn.ModuleDict({"transformer": self.high_noise, "transformer_2": self.transformer_2})

    def uses_high_noise_expert(self, sigma: float | torch.Tensor, batch: int = 1) -> torch.Tensor:
        """``(B,)`` bool on the host: True where ``1000·σ >= boundary`` (the pipeline's ``t >= boundary_timestep``).
        Decided there because the batch is split by it: from σ on a GPU that is one read, from a float none."""
        if isinstance(sigma, torch.Tensor):
            sigma = sigma.cpu()
        return sigma_batch(sigma, batch, "cpu") * self.pipe.scheduler.config.num_train_timesteps >= self.boundary

    @contextmanager
    def _serving(self, expert: torch.nn.Module) -> Iterator[None]:
        # WanPolicy.velocity runs `self.transformer`; point it at the expert for this call
        self.transformer = expert
        try:
            yield
        finally:
            self.transformer = self.high_noise

    def velocity(
        self, x: torch.Tensor, sigma: float | torch.Tensor, cond: Conditioning, guidance: float,
        *, uncond: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``v(x, σ | c)`` float32 ``(B, C, F', H', W')`` from the expert serving each sample's σ; with
        ``uncond`` (:meth:`unconditional_velocity`) only the conditional half runs, as in Wan 2.1."""
        b = x.shape[0]
        s = sigma_batch(sigma, b, self.device)
        high = self.uses_high_noise_expert(sigma, b)  # on the host: the split below reads it
        g2 = self.defaults.get("guidance_scale_2")
        low_guidance = float(g2) if (g2 is not None and guidance > 1) else guidance
        out = None
        for mask, expert, w in ((high, self.high_noise, guidance), (~high, self.transformer_2, low_guidance)):
            if not bool(mask.any()):
                continue
            idx = mask.nonzero().flatten()
            if uncond is not None and w > 1:
                v = cfg_mix(uncond[idx], self.expert_velocity(expert, x[idx], s[idx], cond[idx.tolist()], 1.0), w)
            else:
                v = self.expert_velocity(expert, x[idx], s[idx], cond[idx.tolist()], w)
            if bool(mask.all()):
                return v
            out = torch.zeros_like(x, dtype=torch.float32) if out is None else out
            out[idx] = v
        return out

    def expert_velocity(
        self, expert: torch.nn.Module, x: torch.Tensor, sigma: torch.Tensor, cond: Conditioning, guidance: float
    ) -> torch.Tensor:
        """Wan 2.1's velocity (CFG included) computed by ``expert``."""
        with self._serving(expert):
            return super().velocity(x, sigma, cond, guidance)

    # ------------------------------------------------------------------ adapters

    #: both experts are trained; ``transformer`` is the high-noise one between calls
    trained_modules = ("transformer", "high_noise", "transformer_2")

    @contextmanager
    def adapter_disabled(self) -> Iterator[None]:
        """Both experts' LoRA switched off (the base model's velocity), or under full fine-tuning both
        experts' frozen copies (:meth:`keep_reference`) in their place."""
        if self.reference_modules is not None:
            with lora_utils.swapped_attributes(self, self.reference_modules):
                yield
            return
        with ExitStack() as stack:
            stack.enter_context(lora_utils.adapter_disabled(self.high_noise))
            stack.enter_context(lora_utils.adapter_disabled(self.transformer_2))
            yield

    def save_adapter(self, directory: str | Path) -> None:
        """The two experts' LoRAs in diffusers' format (see the module docstring for the file names)."""
        lora_utils.save_adapter(WanPipeline, self.high_noise, directory)
        if not lora_utils.has_adapter(self.transformer_2):
            raise UserError("save_adapter: transformer_2 has no LoRA adapter")
        from peft.utils import get_peft_model_state_dict

        WanPipeline.save_lora_weights(
            Path(directory),
            transformer_lora_layers=get_peft_model_state_dict(self.transformer_2, adapter_name=lora_utils.ADAPTER_NAME),
            transformer_lora_adapter_metadata=self.transformer_2.peft_config[lora_utils.ADAPTER_NAME].to_dict(),
            weight_name=LORA_WEIGHT_NAME_2,
        )

    def load_adapter(self, directory: str | Path) -> None:
        """Load both experts' LoRAs saved by :meth:`save_adapter` (or a checkpoint folder holding them)."""
        if self.full_finetune:
            raise UserError("load_adapter: this policy fine-tunes full weights; load it with lora={...} or none")
        file = lora_utils.load_adapter(self.pipe, self.high_noise, directory)
        second = file.parent / LORA_WEIGHT_NAME_2
        if not second.is_file():
            raise UserError(f"adapter folder {str(file.parent)!r} has no {LORA_WEIGHT_NAME_2} for the low-noise expert")
        if lora_utils.has_adapter(self.transformer_2):
            # in place: the file's `transformer.` keys are copied into transformer_2's existing adapter
            lora_utils.load_adapter(self.pipe, self.transformer_2, second)
        else:
            self.pipe.load_lora_weights(str(second.parent), weight_name=second.name,
                                        adapter_name=lora_utils.ADAPTER_NAME, load_into_transformer_2=True)
            lora_utils.freeze(self.transformer_2)

