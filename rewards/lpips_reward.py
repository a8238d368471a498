"""The ``lpips`` reward: perceptual closeness to a per-sample reference image (−LPIPS).

For editing: keep what should not change (the background) close to the source image. The reference
comes in ``metadata[i]["reference"]``; ``metadata[i]["mask"]`` optionally restricts the comparison to
the region that should be preserved.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from flowalign.errors import UserError
from rewards.common import RANGE_TOLERANCE, BatchedImageReward
from rewards.model_options import one_of
from rewards.planning import on_meta, option
from rewards.registry import register

NETS = ("alex", "vgg", "squeeze")


def _as_tensor(value: Any, field: str, pil_mode: str) -> torch.Tensor:
    """A path (read with PIL in ``pil_mode``), an array or a tensor → float tensor ``(C, H, W)``."""
    if isinstance(value, (str, Path)):
        from PIL import Image

        if not Path(value).is_file():
            raise UserError(f"lpips reward: {field}={str(value)!r}: no such file")
        with Image.open(value) as im:
            value = im.convert(pil_mode)
    # np.array copies: PIL's and callers' arrays may be read-only
    t = value if isinstance(value, torch.Tensor) else torch.from_numpy(np.array(value))
    if t.dtype == torch.uint8:
        t = t.float() / 255
    elif t.dtype == torch.bool:
        t = t.float()
    if not t.is_floating_point():
        raise UserError(f"lpips reward: {field} must be float in [0, 1], uint8 or bool; got {t.dtype}")
    if t.numel() and (t.min() < -RANGE_TOLERANCE or t.max() > 1 + RANGE_TOLERANCE):
        raise UserError(f"lpips reward: {field} must lie in [0, 1] (or be uint8); got [{t.min():.3g}, {t.max():.3g}]")
    if t.ndim == 3 and t.shape[-1] in (1, 3) and t.shape[0] not in (1, 3):  # HWC from PIL / numpy
        t = t.permute(2, 0, 1)
    return t.float() if t.ndim == 3 else t[None].float()


def load_reference(value: Any, field: str, size: tuple[int, int]) -> torch.Tensor:
    """Reference image ``(3, H, W)`` in [0, 1] at the samples' size (antialiased resize if needed)."""
    ref = _as_tensor(value, field, "RGB")
    if ref.shape[0] != 3:
        raise UserError(f"lpips reward: {field} must be an RGB image (3, H, W) or (H, W, 3); got {tuple(ref.shape)}")
    if tuple(ref.shape[-2:]) != size:
        ref = F.interpolate(ref[None], size=size, mode="bilinear", antialias=True, align_corners=False)[0]
    return ref.clamp(0, 1)


def load_mask(value: Any, field: str, size: tuple[int, int]) -> torch.Tensor:
    """Preservation mask ``(1, H, W)`` in [0, 1] at the samples' size (1 = compare this pixel)."""
    mask = _as_tensor(value, field, "L")
    if mask.shape[0] != 1:
        raise UserError(f"lpips reward: {field} must be a single-channel mask (H, W) or (1, H, W); got {tuple(mask.shape)}")
    if tuple(mask.shape[-2:]) != size:
        mask = F.interpolate(mask[None], size=size, mode="nearest")[0]
    if mask.sum() <= 0:
        raise UserError(f"lpips reward: {field} selects no pixel; give a mask with ones where the image must be preserved")
    return mask.clamp(0, 1)


@register("lpips")
class LPIPSReward(BatchedImageReward):
    """``score_i = −LPIPS(x_i, reference_i)`` (0 for a perfect copy, lower when further away).

    The distance is the mean of LPIPS's spatial map (per-layer distances upsampled to the image, equal
    to the plain LPIPS value up to that upsampling), over the masked pixels when a mask is given. Options: ``net``
    (``"alex"``, ``"vgg"`` or ``"squeeze"``), ``backbone_path`` (torchvision ImageNet weights of that
    net, e.g. ``alexnet-owt-7be5be79.pth``; None: torchvision's cache, downloading when missing),
    ``random_init`` (random backbone, nothing read or fetched), ``batch_size``, ``device``,
    ``dtype``. The calibrated linear layers always come from the ``lpips`` package, which ships them,
    so the distance stays a non-negative weighting of feature differences. Differentiable.
    """

    name = "lpips"

    def __init__(self, net: str = "alex", backbone_path: str | None = None, *, random_init: bool = False,
                 **options: Any):
        super().__init__(**options)
        import lpips

        one_of("lpips reward", "net", net, NETS)
        fetch = not random_init and backbone_path is None
        with warnings.catch_warnings():  # lpips passes torchvision's deprecated `pretrained=` flag
            warnings.simplefilter("ignore", UserWarning)
            try:
                model = lpips.LPIPS(net=net, pretrained=True, pnet_rand=not fetch, spatial=True, verbose=False)
            except (OSError, RuntimeError) as e:  # torchvision could not fetch the ImageNet backbone
                raise UserError(
                    f"lpips reward: could not get torchvision's ImageNet weights for net={net!r} ({e});"
                    " give backbone_path=<torchvision checkpoint file>, or random_init=True"
                ) from e
        if backbone_path is not None and not random_init:
            self._load_backbone(model, backbone_path)
        self.model = model.to(self.dtype).eval().requires_grad_(False)

    @classmethod
    def planned_modules(cls, options: dict[str, Any]) -> list[torch.nn.Module]:
        """LPIPS of ``net`` on the meta device: the backbone of torchvision's architecture, nothing fetched."""
        import lpips

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return [on_meta(lambda: lpips.LPIPS(net=option(cls, options, "net"), pretrained=True, pnet_rand=True,
                                                spatial=True, verbose=False))]

    @staticmethod
    def _load_backbone(model: torch.nn.Module, path: str) -> None:
        """Load a torchvision ``<net>.features`` checkpoint into lpips's sliced copy of it.

        lpips splits ``features`` into ``slice1..N`` but keeps each layer's index as its name, so
        ``features.{k}.*`` maps to ``slice{j}.{k}.*``.
        """
        if not Path(path).is_file():
            raise UserError(f"lpips reward: backbone_path={path!r}: no such file; give a torchvision checkpoint")
        state = torch.load(path, map_location="cpu", weights_only=True)
        target = {re.sub(r"^slice\d+\.", "features.", k): k for k in model.net.state_dict()}
        missing = sorted(set(target) - set(state))
        if missing:
            raise UserError(f"lpips reward: backbone_path={path!r} lacks {missing[:3]}...; is it the torchvision"
                            " checkpoint of the chosen net?")
        model.net.load_state_dict({target[k]: state[k] for k in target})

    def modules(self) -> list[torch.nn.Module]:
        return [self.model]

    def context(self, prompts: list[str], metadata: list[dict[str, Any]], samples: torch.Tensor,
                device: torch.device) -> tuple[torch.Tensor, ...]:
        """References ``(B, 3, H, W)`` and masks ``(B, 1, H, W)`` (all ones where none is given)."""
        size = tuple(samples.shape[-2:])
        refs, masks = [], []
        for i in range(samples.shape[0]):
            meta = metadata[i] if metadata else {}
            if meta.get("reference") is None:
                raise UserError(
                    f"lpips reward: metadata[{i}] has no 'reference'; put the image to stay close to (a path,"
                    " an array or a (3, H, W) tensor in [0, 1]) in metadata[i]['reference']"
                )
            refs.append(load_reference(meta["reference"], f'metadata[{i}]["reference"]', size))
            mask = meta.get("mask")
            masks.append(torch.ones(1, *size) if mask is None else load_mask(mask, f'metadata[{i}]["mask"]', size))
        return torch.stack(refs).to(device), torch.stack(masks).to(device)

    def score_batch(self, images: torch.Tensor, reference: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        dist = self.model(images.to(self.dtype), reference.to(self.dtype), normalize=True).float()  # (b, 1, H, W)
        return -(dist * mask).sum((1, 2, 3)) / mask.sum((1, 2, 3))
