"""Frozen image feature encoders: a decoded image batch ``(B, 3, H, W)`` in [0, 1] → unit features ``(B, D)``.

What a reward compares images with (``image_similarity``) and what GARDO's diversity factor measures distances
in (``trainer.diversity_features: image_encoder``; the core finds these classes through the ``encoders``
plugin table, :mod:`flowalign.plugins`). Each loads a transformers folder with the real ``from_pretrained``
(nothing is fetched at run time) and runs frozen, in eval mode; ``encode_images`` is differentiable in the
images (call it under ``torch.no_grad()`` where no gradient is wanted).

Every encoder is built as ``Encoder(path, who=..., option=..., dtype=..., random_init=..., **options)``:
``who`` and ``option`` name the setting in the one-line error a missing or wrong folder gives.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F

from flowalign.errors import UserError
from rewards.clip_common import clip_preprocess
from rewards.model_options import weights_path
from rewards.planning import existing, missing, module_bytes, on_meta, published

DOWNLOADS = {"dinov2": "facebook/dinov2-base (the model folder)",
             "dinov3": "facebook/dinov3-vitl16-pretrain-lvd1689m (the model folder)"}

#: DINOv3 releases whose configs ship (assets/reward_architectures/), by what their folder names contain
DINOV3_RELEASES = {"vitl16": "dinov3-vitl16"}

#: timm's IMAGENET_DEFAULT_MEAN / _STD, what the DINOv3 checkpoints were trained with
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def model_folder(who: str, path: Any, option: str, download: str) -> Path:
    """``path`` as an existing folder, else one line naming ``who``, the ``option`` and what to download."""
    return weights_path(who, path, download=download, option=option, kind="folder", label=who)


class DINOv2:
    """A frozen transformers ``Dinov2Model`` folder; an image's feature is ``pooler_output`` (the final
    layer-normed CLS token), preprocessed as its ``BitImageProcessor`` (shortest side to 256, bicubic,
    224 centre crop, ImageNet mean/std)."""

    def __init__(self, path: Any, *, who: str = "dinov2 encoder", option: str = "path",
                 dtype: torch.dtype = torch.float32, random_init: bool = False):
        from transformers import AutoImageProcessor, Dinov2Config, Dinov2Model

        folder = model_folder(who, path, option, DOWNLOADS["dinov2"])
        try:
            net = Dinov2Model(Dinov2Config.from_pretrained(folder)) if random_init else Dinov2Model.from_pretrained(folder)
            processor = AutoImageProcessor.from_pretrained(folder)
        except (OSError, ValueError) as e:
            raise UserError(f"{who}: {option}={str(folder)!r} is not a DINOv2 folder ({str(e).splitlines()[0]}); "
                            "give the downloaded folder (config.json, model.safetensors, preprocessor_config.json)") from None
        self.model = net.to(dtype).eval().requires_grad_(False)
        crop = processor.crop_size
        self.size = (crop["height"], crop["width"])
        self.shortest_edge = processor.size.get("shortest_edge")
        self.mean, self.std = processor.image_mean, processor.image_std
        self.dtype = dtype

    @staticmethod
    def planned_module(path: Any) -> torch.nn.Module:
        """The ``Dinov2Model`` of ``path``'s ``config.json`` on the meta device (DINOv2 comes in several sizes,
        so a folder that does not exist is not sized)."""
        from transformers import Dinov2Config, Dinov2Model

        folder = existing(path)
        if folder is None:
            raise missing("path", path)
        config = Dinov2Config.from_pretrained(folder)
        return on_meta(lambda: Dinov2Model(config))

    @classmethod
    def planned_bytes(cls, path: Any, *, dtype: torch.dtype = torch.float32, **options: Any) -> int:
        """Bytes of the encoder ``path`` holds, in ``dtype``, sized on the meta device."""
        return module_bytes([cls.planned_module(path).to(dtype)])

    def encode_images(self, images: torch.Tensor) -> torch.Tensor:
        """``(B, 3, H, W)`` in [0, 1] → unit CLS features ``(B, D)`` (float32)."""
        x = clip_preprocess(images, self.size, self.mean, self.std, shortest_edge=self.shortest_edge)
        return F.normalize(self.model(pixel_values=x.to(self.dtype)).pooler_output.float(), dim=-1)


class DINOv3:
    """A frozen transformers ``DINOv3ViTModel`` folder (e.g. facebook/dinov3-vitl16-pretrain-lvd1689m).

    Defaults are the GARDO authors' (``timm.create_model('vit_large_patch16_dinov3.lvd1689m')`` with timm's
    eval transform): the shortest side resized to ``resolution`` = 256 (bicubic, antialiased), a centre crop of
    256 × 256, ImageNet mean/std; the feature is timm's default ``avg`` pool of that model, the mean of the
    final layer-normed *patch* tokens (CLS and register tokens left out: ``pool="patch_mean"``).
    ``pool="cls"`` takes the CLS token (``pooler_output``, DINOv3's own pooled output) instead. The folder's
    ``preprocessor_config.json`` (224 px, bilinear) is not read: the authors' preprocessing is timm's.
    """

    def __init__(self, path: Any, *, who: str = "dinov3 encoder", option: str = "path",
                 dtype: torch.dtype = torch.float32, random_init: bool = False, resolution: int = 256,
                 pool: Literal["patch_mean", "cls"] = "patch_mean"):
        from transformers import DINOv3ViTConfig, DINOv3ViTModel

        if pool not in ("patch_mean", "cls"):
            raise UserError(f"{who}: pool={pool!r} is not known; use patch_mean (the GARDO authors') or cls")
        if isinstance(resolution, bool) or not isinstance(resolution, int) or resolution < 16:
            raise UserError(f"{who}: resolution={resolution!r} must be an integer of at least 16 (the patch side)")
        folder = model_folder(who, path, option, DOWNLOADS["dinov3"])

        def not_dinov3(why: str) -> UserError:
            return UserError(f"{who}: {option}={str(folder)!r} is not a DINOv3 ViT folder ({why}); download "
                             f"{DOWNLOADS['dinov3']} (config.json with model_type dinov3_vit, model.safetensors)")

        # transformers reads another model type's config with a warning and leaves the weights it lacks random:
        # a wrong folder is refused here rather than yielding a random encoder
        try:
            found = json.loads((folder / "config.json").read_text()).get("model_type")
        except (OSError, ValueError) as e:
            raise not_dinov3(str(e).splitlines()[0]) from None
        if found != "dinov3_vit":
            raise not_dinov3(f"its config.json has model_type {found!r}")
        try:
            config = DINOv3ViTConfig.from_pretrained(folder)
            if random_init:
                net = DINOv3ViTModel(config)
            else:
                net, info = DINOv3ViTModel.from_pretrained(folder, output_loading_info=True)
                absent = [str(k) for k in (info.get("missing_keys") or [])] + [
                    str(k[0] if isinstance(k, tuple) else k) for k in (info.get("mismatched_keys") or [])]
                if absent:
                    raise not_dinov3(f"weights missing or mis-shaped: {', '.join(sorted(absent)[:3])}")
        except (OSError, ValueError) as e:
            raise not_dinov3(str(e).splitlines()[0]) from None
        self.model = net.to(dtype).eval().requires_grad_(False)
        # the sequence is [CLS, registers…, patches…]: the patch mean starts after them
        self.prefix = 1 + int(config.num_register_tokens)
        self.resolution, self.pool, self.dtype = resolution, pool, dtype

    @classmethod
    def planned_bytes(cls, path: Any, *, dtype: torch.dtype = torch.float32, **options: Any) -> int:
        """Bytes of the encoder ``path`` holds, in ``dtype``: its ``config.json``'s model on the meta device; a
        folder that does not exist yet is sized as the release its name says where one ships
        (``assets/reward_architectures/dinov3-vitl16``: the GARDO authors' ViT-L/16), else not at all."""
        from transformers import DINOv3ViTConfig, DINOv3ViTModel

        folder = existing(path)
        if folder is None:
            name = Path(str(path)).name.lower() if path else ""
            release = next((arch for key, arch in DINOV3_RELEASES.items() if key in name), None)
            if release is None:
                raise missing("path", path)
            folder = published(release)
        config = DINOv3ViTConfig.from_pretrained(folder)
        return module_bytes([on_meta(lambda: DINOv3ViTModel(config)).to(dtype)])

    def encode_images(self, images: torch.Tensor) -> torch.Tensor:
        """``(B, 3, H, W)`` in [0, 1] → unit features ``(B, D)`` (float32): the patch-token mean (or CLS)."""
        x = clip_preprocess(images, self.resolution, IMAGENET_MEAN, IMAGENET_STD)
        out = self.model(pixel_values=x.to(device=self.device, dtype=self.dtype))
        if self.pool == "cls":
            features = out.pooler_output
        else:
            features = out.last_hidden_state[:, self.prefix :].mean(dim=1)
        return F.normalize(features.float(), dim=-1)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device
