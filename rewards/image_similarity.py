"""The ``image_similarity`` reward (editing): cosine of image features between a sample and its reference image."""

from __future__ import annotations

from typing import Any

import torch

from flowalign.protocols import RewardOutput
from flowalign.sampling.inputs import load_input_image
from rewards.clip_common import load_clip, meta_clip
from rewards.common import BatchedImageReward
from rewards.image_encoders import DINOv2
from rewards.model_options import one_of
from rewards.planning import option
from rewards.registry import register

DOWNLOADS = {"dinov2": "facebook/dinov2-base (the model folder)",
             "clip": "a CLIP model (e.g. openai/clip-vit-large-patch14)"}


@register("image_similarity")
class ImageSimilarity(BatchedImageReward):
    """``score_i = cos(f(x_i), f(ref_i))`` in [-1, 1]: how much of the reference image an edit keeps.

    ``ref_i`` is sample ``i``'s ``metadata[key]`` (default ``image``: an editing prompt's source image, a
    path, PIL image, ``(3, H, W)`` tensor or a callable rendering one); a sample without one is invalid.
    Options: ``backbone`` (``dinov2``: a transformers ``Dinov2Model`` folder such as facebook/dinov2-base,
    the CLS feature; ``clip``: CLIP image embeddings, ``path`` as for ``clip_score``), ``path``, ``key``,
    ``random_init``, ``batch_size``, ``device``, ``dtype``. Differentiable in the samples.
    """

    name = "image_similarity"

    def __init__(self, path: str | None = None, *, backbone: str = "dinov2", key: str = "image",
                 arch: str = "ViT-L-14-quickgelu", random_init: bool = False, **options: Any):
        super().__init__(**options)
        one_of("image_similarity reward", "backbone", backbone, DOWNLOADS)
        self.key = key
        if backbone == "dinov2":
            self.encoder: Any = DINOv2(path, who=f"{self.name} reward", dtype=self.dtype, random_init=random_init)
        else:
            self.encoder = load_clip(self.name, path, arch=arch, dtype=self.dtype, download=DOWNLOADS["clip"],
                                     random_init=random_init)

    def modules(self) -> list[torch.nn.Module]:
        return [self.encoder.model]

    @classmethod
    def planned_modules(cls, options: dict[str, Any]) -> list[torch.nn.Module]:
        """The encoder of ``backbone`` on the meta device, from ``path``'s config (any DINOv2 or CLIP may be named,
        so a ``path`` that does not exist is not sized)."""
        if option(cls, options, "backbone") == "dinov2":
            return [DINOv2.planned_module(options.get("path"))]
        return [meta_clip(options.get("path"), arch=option(cls, options, "arch"))]

    @torch.no_grad()
    def context(self, prompts: list[str], metadata: list[dict[str, Any]], samples: torch.Tensor,
                device: torch.device) -> tuple[torch.Tensor, ...]:
        """Reference features ``(B, D)`` (zeros for a sample without a reference), one image at a time: the
        references may differ in size."""
        refs = [m.get(self.key) if m else None for m in (metadata or [{}] * samples.shape[0])]
        feats = [self.encoder.encode_images(load_input_image(r)[None].to(device)) if r is not None else None
                 for r in refs]
        dim = next((f.shape[-1] for f in feats if f is not None), 1)
        return (torch.cat([f if f is not None else torch.zeros(1, dim, device=device) for f in feats]),)

    def score_batch(self, images: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
        return (self.encoder.encode_images(images) * reference).sum(-1)

    def __call__(self, samples: torch.Tensor, prompts: list[str], metadata: list[dict[str, Any]]) -> RewardOutput:
        out = super().__call__(samples, prompts, metadata)
        has_ref = torch.tensor([bool(metadata) and metadata[i].get(self.key) is not None
                                for i in range(samples.shape[0])], device=out.valid.device)
        return RewardOutput(out.components, valid=out.valid & has_ref, info=out.info)
