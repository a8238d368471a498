"""The ``image_similarity`` reward (editing): cosine of image features between a sample and its reference image."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from flowalign.errors import UserError
from flowalign.protocols import RewardOutput
from flowalign.sampling.inputs import load_input_image
from rewards.clip_common import clip_preprocess, load_clip
from rewards.common import BatchedImageReward
from rewards.model_options import weights_path
from rewards.registry import register

DOWNLOADS = {"dinov2": "facebook/dinov2-base (the model folder)",
             "clip": "a CLIP model (e.g. openai/clip-vit-large-patch14)"}


class DINOv2:
    """A frozen transformers ``Dinov2Model`` folder; an image's feature is ``pooler_output`` (the final
    layer-normed CLS token), preprocessed as its ``BitImageProcessor`` (shortest side to 256, bicubic,
    224 centre crop, ImageNet mean/std)."""

    def __init__(self, who: str, path: Any, dtype: torch.dtype, random_init: bool):
        from transformers import AutoImageProcessor, Dinov2Config, Dinov2Model

        folder = weights_path(who, path, download=DOWNLOADS["dinov2"], kind="folder")
        try:
            net = Dinov2Model(Dinov2Config.from_pretrained(folder)) if random_init else Dinov2Model.from_pretrained(folder)
            processor = AutoImageProcessor.from_pretrained(folder)
        except (OSError, ValueError) as e:
            raise UserError(f"{who} reward: path={str(folder)!r} is not a DINOv2 folder ({str(e).splitlines()[0]}); "
                            "give the downloaded folder (config.json, model.safetensors, preprocessor_config.json)") from None
        self.model = net.to(dtype).eval().requires_grad_(False)
        crop = processor.crop_size
        self.size = (crop["height"], crop["width"])
        self.shortest_edge = processor.size.get("shortest_edge")
        self.mean, self.std = processor.image_mean, processor.image_std
        self.dtype = dtype

    def encode_images(self, images: torch.Tensor) -> torch.Tensor:
        x = clip_preprocess(images, self.size, self.mean, self.std, shortest_edge=self.shortest_edge)
        return F.normalize(self.model(pixel_values=x.to(self.dtype)).pooler_output.float(), dim=-1)


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
        if backbone not in DOWNLOADS:
            raise UserError(f"image_similarity reward: backbone={backbone!r} is not known; use dinov2 or clip")
        self.key = key
        if backbone == "dinov2":
            self.encoder: Any = DINOv2(self.name, path, self.dtype, random_init)
        else:
            self.encoder = load_clip(self.name, path, arch=arch, dtype=self.dtype, download=DOWNLOADS["clip"],
                                     random_init=random_init)

    def modules(self) -> list[torch.nn.Module]:
        return [self.encoder.model]

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
