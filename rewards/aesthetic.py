"""The ``aesthetic`` reward: the LAION aesthetic predictor (an MLP head on CLIP image embeddings)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from flowalign.errors import UserError
from rewards.clip_common import CROP_OFFSET_MEANINGS, OpenCLIP, clip_embed_dim, load_clip, meta_clip, meta_open_clip
from rewards.clip_common import use_pixels
from rewards.common import EmbeddingReward
from rewards.model_options import deprecated, one_of, weights_path
from rewards.planning import existing, on_meta
from rewards.registry import register


HEAD_DOWNLOAD = "sac+logos+ava1-l14-linearMSE.pth (christophschuhmann/improved-aesthetic-predictor)"
CLIP_DOWNLOAD = "openai/clip-vit-large-patch14"
#: where an odd margin puts the centre crop: ``floor`` as transformers' CLIPProcessor (Flow-GRPO's scorer),
#: ``round`` as torchvision's CenterCrop (open_clip's and the predictor's own ``clip.load``; the earlier form)
CROP_OFFSETS = ("floor", "round")


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
    path = weights_path("aesthetic", path, download=HEAD_DOWNLOAD, kind="file")
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(path)
    state = torch.load(path, map_location="cpu", weights_only=True)
    return state.get("state_dict", state)


def head_file(folder: Path) -> Path:
    """The one head file (``*.pth``/``*.pt``/``*.safetensors``) at the top of ``folder``."""
    found = sorted(p for p in folder.iterdir() if p.suffix in (".pth", ".pt", ".safetensors") and p.is_file())
    if len(found) != 1:
        raise UserError(f"aesthetic reward: path={str(folder)!r} must hold exactly one head file (.pth or "
                        f".safetensors), found {len(found)}; give the head file itself as path:")
    return found[0]


@register("aesthetic")
class AestheticScore(EmbeddingReward):
    """``score_i = head(normalise(E_img(x_i)))``: the LAION aesthetic score (AVA 1-10 scale), as Flow-GRPO's
    and the improved-aesthetic-predictor's scorers compute it; differentiable in the samples.

    Options: ``path`` (the head file ``sac+logos+ava1-l14-linearMSE.pth``, or a folder holding it and the
    CLIP model as ``clip/``), ``clip_path`` (the CLIP ViT-L/14 the head was trained on:
    ``openai/clip-vit-large-patch14``, a transformers or open_clip folder or an open_clip checkpoint file;
    default ``path``'s ``clip/``), ``clip_arch`` (the open_clip architecture of a checkpoint file),
    ``random_init`` (random backbone and head, nothing read), ``crop_offset`` (``floor``, default: an odd
    margin's centre crop placed as Flow-GRPO's ``CLIPProcessor`` places it; ``round``: as torchvision's
    ``CenterCrop``, the earlier form), ``pixels`` (``float``, default: the processor's steps in torch,
    differentiable; ``pil``: the 8-bit images through the CLIP's own preprocessing of PIL images, a transformers
    CLIP's as Flow-GRPO's scorer reads them, no gradient), ``batch_size``, ``device``, ``dtype``. The float path differs from Flow-GRPO's scorer
    by PIL's 8-bit rounding only (docs/methods/flow_grpo.md).
    Deprecated: ``head_path`` (→ ``path``), ``model``/``pretrained`` (→ ``clip_path``).
    """

    name = "aesthetic"
    #: runs saved without ``crop_offset`` cropped as torchvision rounds (the former default;
    #: rewards.registry.former_forms)
    before: ClassVar[dict[str, Any]] = {"crop_offset": "round"}

    def __init__(self, path: str | None = None, *, clip_path: str | None = None,
                 clip_arch: str = "ViT-L-14-quickgelu", head_path: str | None = None, model: str | None = None,
                 pretrained: str | None = None, random_init: bool = False, crop_offset: str = "floor",
                 pixels: str = "float", **options: Any):
        super().__init__(**options)
        one_of("aesthetic reward", "crop_offset", crop_offset, CROP_OFFSETS, CROP_OFFSET_MEANINGS)
        if head_path is not None:
            deprecated(self.name, "head_path", "path:")
            path = path or head_path
        self.clip: Any
        if model is not None or pretrained is not None:  # the open_clip options of earlier versions
            for old, value in (("model", model), ("pretrained", pretrained)):
                if value is not None:
                    deprecated(self.name, old, "clip_path:")
            self.clip = OpenCLIP(self.name, model or clip_arch, pretrained, random_init, self.dtype, CLIP_DOWNLOAD)
        elif random_init and path is None and clip_path is None:
            self.clip = OpenCLIP(self.name, clip_arch, None, True, self.dtype, CLIP_DOWNLOAD)
        else:
            given = weights_path(self.name, path, download=HEAD_DOWNLOAD)
            if clip_path is None and given.is_dir() and (given / "clip").is_dir():
                clip_path = str(given / "clip")
            if clip_path is None:
                raise UserError(f"aesthetic reward: clip_path is not set; download {CLIP_DOWNLOAD} and give its "
                                "local folder as clip_path: (or put it beside the head as path/clip)")
            self.clip = load_clip(self.name, clip_path, arch=clip_arch, dtype=self.dtype, download=CLIP_DOWNLOAD,
                                  option="clip_path", random_init=random_init)
        self.clip.crop_offset = crop_offset
        use_pixels(self, self.name, self.clip, pixels, crop_offset)
        self.head = AestheticHead(self.clip.embed_dim)
        if not random_init:
            given = weights_path(self.name, path, download=HEAD_DOWNLOAD)
            head = head_file(given) if given.is_dir() else given
            try:
                self.head.load_state_dict(load_head_state(head))
            except RuntimeError as e:  # wrong keys or shapes: a head for another backbone or format
                raise UserError(
                    f"aesthetic reward: path={str(head)!r} is not a LAION aesthetic MLP for a"
                    f" {self.clip.embed_dim}-d CLIP embedding: {str(e).splitlines()[0]}"
                ) from None
        self.head = self.head.to(self.dtype).eval().requires_grad_(False)

    def modules(self) -> list[torch.nn.Module]:
        return [self.clip.model, self.head]

    @classmethod
    def planned_modules(cls, options: dict[str, Any]) -> list[torch.nn.Module]:
        """The CLIP and the head of ``options`` on the meta device. The head reads the embeddings of the CLIP
        it was trained on (``clip_arch``, OpenAI's ViT-L/14), so a ``clip_path`` not given or not there yet is
        sized as that architecture."""
        arch = options.get("clip_arch", "ViT-L-14-quickgelu")
        model, path = options.get("model"), options.get("path") or options.get("head_path")
        clip_path = options.get("clip_path")
        if model is not None or options.get("pretrained") is not None:
            clip = meta_open_clip(model or arch)
        else:
            given = existing(path)
            if clip_path is None and given is not None and (given / "clip").is_dir():
                clip_path = str(given / "clip")
            clip = meta_clip(clip_path, arch=arch) if existing(clip_path) is not None else meta_open_clip(arch)
        return [clip, on_meta(lambda: AestheticHead(clip_embed_dim(clip)))]

    def embed(self, images: torch.Tensor) -> torch.Tensor:
        """Unit-norm CLIP image embeddings ``(b, D)``, what the head reads."""
        return self.clip.encode_images(images)

    def score_features(self, features: torch.Tensor) -> torch.Tensor:
        return self.head(features.to(self.dtype)).float()
