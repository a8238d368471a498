"""The ``aesthetic`` reward: the LAION aesthetic predictor (an MLP head on CLIP image embeddings)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from flowalign.errors import UserError
from rewards.clip_common import OpenCLIP
from rewards.common import BatchedImageReward
from rewards.registry import register


class AestheticHead(nn.Module):
    """LAION improved-aesthetic-predictor MLP: unit-norm CLIP embedding ``(B, D)`` → score ``(B,)``.

    Layer layout (and so the state-dict keys ``layers.{0,2,4,6,7}.*``) as in
    ``sac+logos+ava1-l14-linearMSE.pth``, trained on OpenAI CLIP ViT-L/14 embeddings (``D = 768``);
    scores are on the AVA 1-10 scale.
    """

    def __init__(self, embed_dim: int = 768):
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(embed_dim, 1024), nn.Dropout(0.2),
            nn.Linear(1024, 128), nn.Dropout(0.2),
            nn.Linear(128, 64), nn.Dropout(0.1),
            nn.Linear(64, 16),
            nn.Linear(16, 1),
        )

    def forward(self, embeddings: torch.Tensor) -> torch.Tensor:
        return self.layers(embeddings).squeeze(-1)


def load_head_state(path: str | Path) -> dict[str, torch.Tensor]:
    """State dict of a head saved as ``.safetensors`` or as a torch pickle (``.pth``/``.pt``)."""
    path = Path(path)
    if not path.is_file():
        raise UserError(
            f"aesthetic reward: head_path={str(path)!r}: no such file; give the LAION aesthetic head"
            " (sac+logos+ava1-l14-linearMSE.pth) or random_init=True"
        )
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(path)
    state = torch.load(path, map_location="cpu", weights_only=True)
    return state.get("state_dict", state)


@register("aesthetic")
class AestheticScore(BatchedImageReward):
    """``score_i = head(normalise(E_img(x_i)))``: the LAION aesthetic score, differentiable in the samples.

    Options: ``head_path`` (the head's ``.pth``/``.safetensors``), ``model``/``pretrained`` (the CLIP
    backbone the head was trained on; default OpenAI ViT-L/14), ``random_init`` (random backbone and
    head, nothing read), ``batch_size``, ``device``, ``dtype``.
    """

    name = "aesthetic"

    def __init__(self, head_path: str | None = None, model: str = "ViT-L-14-quickgelu",
                 pretrained: str | None = "openai", *, random_init: bool = False, **options: Any):
        super().__init__(**options)
        if head_path is None and not random_init:
            raise UserError(
                "aesthetic reward: head_path is not set; give the LAION aesthetic head file"
                " (sac+logos+ava1-l14-linearMSE.pth), or random_init=True"
            )
        self.clip = OpenCLIP(self.name, model, pretrained, random_init, self.dtype)
        self.head = AestheticHead(self.clip.embed_dim)
        if not random_init:
            try:
                self.head.load_state_dict(load_head_state(head_path))
            except RuntimeError as e:  # wrong keys or shapes: a head for another backbone or format
                raise UserError(
                    f"aesthetic reward: head_path={head_path!r} is not a LAION aesthetic MLP for a"
                    f" {self.clip.embed_dim}-d CLIP embedding: {e}"
                ) from e
        self.head = self.head.to(self.dtype).eval().requires_grad_(False)

    def modules(self) -> list[torch.nn.Module]:
        return [self.clip.model, self.head]

    def score_batch(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.clip.encode_images(images).to(self.dtype)).float()
