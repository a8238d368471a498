"""The ``clip_score`` reward: cosine similarity of CLIP image and prompt embeddings."""

from __future__ import annotations

from typing import Any

import torch

from rewards.clip_common import WEIGHTS_HINT, OpenCLIP, unique_rows
from rewards.common import BatchedImageReward
from rewards.registry import register


@register("clip_score")
class CLIPScore(BatchedImageReward):
    """``score_i = cos(E_img(x_i), E_txt(prompt_i))`` in [-1, 1] with an open_clip model.

    Options: ``model`` (open_clip architecture, ``local-dir:<folder>`` or ``hf-hub:<repo>``;
    default OpenAI CLIP ViT-L/14), ``pretrained`` (checkpoint file or open_clip tag), ``random_init``
    (random weights, nothing read), plus ``batch_size``, ``device``, ``dtype`` (see
    :class:`~rewards.common.BatchedImageReward`). Differentiable in the samples.
    """

    name = "clip_score"
    weights_hint = WEIGHTS_HINT

    def __init__(self, model: str = "ViT-L-14-quickgelu", pretrained: str | None = "openai", *,
                 random_init: bool = False, **options: Any):
        super().__init__(**options)
        self.clip = OpenCLIP(self.name, model, pretrained, random_init, self.dtype, self.weights_hint)

    def modules(self) -> list[torch.nn.Module]:
        return [self.clip.model]

    def context(self, prompts: list[str], metadata: list[dict[str, Any]], samples: torch.Tensor,
                device: torch.device) -> tuple[torch.Tensor, ...]:
        """Text embeddings ``(B, D)``, one encoder pass per distinct prompt."""
        distinct, rows = unique_rows(prompts)
        return (self.clip.encode_texts(distinct, device, self.batch_size)[rows.to(device)],)

    def score_batch(self, images: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        return (self.clip.encode_images(images) * text).sum(-1)
