"""CLIP plumbing shared by the CLIP-based rewards: torch preprocessing and open_clip loading.

Preprocessing is done with torch ops (resize, centre crop, normalise) instead of the PIL transforms
the models ship with, so gradients reach the pixels and nothing leaves the device.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from flowalign.errors import UserError
from flowalign.protocols import NotSized
from rewards.common import constant, to_pil
from rewards.model_options import one_of
from rewards.planning import existing, missing, on_meta

#: where a centre crop of an odd margin starts: what each ``crop_offset`` value follows
CROP_OFFSET_MEANINGS = {"round": "torchvision's CenterCrop", "floor": "CLIPImageProcessor's"}
#: how an image reward's model input is made (``pixels:``; the CLIP rewards and imagereward)
PIXELS = {"float": "the preprocessing in torch on the float images (differentiable)",
          "pil": "the model's own preprocessing of 8-bit PIL images, as its reference scorer reads them (no gradient)"}

_WEIGHT_SUFFIXES = (".pt", ".pth", ".bin", ".safetensors", ".npz")
#: what an error asks for when open_clip weights are missing (rewards with special weights say more)
WEIGHTS_HINT = "a checkpoint file or an open_clip tag such as 'openai'"


def clip_preprocess(
    images: torch.Tensor,
    size: int | Sequence[int],
    mean: Sequence[float],
    std: Sequence[float],
    resize_mode: str = "shortest",
    interpolation: str = "bicubic",
    shortest_edge: int | None = None,
    crop_offset: str = "round",
) -> torch.Tensor:
    """``(B, 3, H, W)`` in [0, 1] → ``(B, 3, h, w)`` normalised model input, differentiable.

    ``resize_mode="longest_pad"`` scales the longest side to a square target and pads with zeros around it
    (the hpsv2 scorer's ``ResizeMaxSize``); ``resize_mode="shortest"`` scales the shortest side to the target and
    centre-crops (CLIP's
    ``Resize`` + ``CenterCrop``), or to ``shortest_edge`` first where a processor resizes beyond its crop
    (DINOv2: 256 then a 224 crop); ``"squash"`` resizes straight to the target. Resampling is
    antialiased like PIL's, so large generated images are downsampled without aliasing. Works in
    float32 (CPU antialiased bicubic has no bf16 kernel); cast the result to the model dtype.
    ``crop_offset`` places the centre crop where an odd margin leaves half a pixel: ``"round"`` as
    torchvision's ``CenterCrop`` (half to even), ``"floor"`` as transformers' image processors (``⌊margin/2⌋``).
    """
    th, tw = (size, size) if isinstance(size, int) else tuple(size)
    h, w = images.shape[-2:]
    x = images.float()
    if resize_mode == "shortest":
        # output sizes and crop offsets computed as torchvision's Resize / CenterCrop do
        if shortest_edge is not None:  # transformers' get_resize_output_image_size: int(edge · long / short)
            nh, nw = (shortest_edge, int(shortest_edge * w / h)) if h <= w else (int(shortest_edge * h / w), shortest_edge)
        elif th / h >= tw / w:
            nh, nw = th, max(tw, int(th * w / h))
        else:
            nh, nw = max(th, int(tw * h / w)), tw
        if (nh, nw) != (h, w):
            x = F.interpolate(x, size=(nh, nw), mode=interpolation, align_corners=False, antialias=True)
        if crop_offset == "floor":
            top, left = (nh - th) // 2, (nw - tw) // 2
        elif crop_offset == "round":
            top, left = int(round((nh - th) / 2.0)), int(round((nw - tw) / 2.0))
        else:
            raise UserError(f"CLIP preprocessing: crop_offset={crop_offset!r} is not supported; use 'round' or 'floor'")
        x = x[..., top : top + th, left : left + tw]
    elif resize_mode == "longest_pad":
        # the hpsv2 scorer's ResizeMaxSize: the longest side to the (square) target, each side rounded, then
        # zeros around the image, centred (the left/top margin the smaller half)
        if th != tw:
            raise UserError(f"CLIP preprocessing: resize_mode='longest_pad' pads to a square, not {th}x{tw}")
        nh, nw = (round(d * th / max(h, w)) for d in (h, w))
        if (nh, nw) != (h, w):
            x = F.interpolate(x, size=(nh, nw), mode=interpolation, align_corners=False, antialias=True)
        ph, pw = th - nh, tw - nw
        x = F.pad(x, (pw // 2, pw - pw // 2, ph // 2, ph - ph // 2))
    elif resize_mode == "squash":
        if (th, tw) != (h, w):
            x = F.interpolate(x, size=(th, tw), mode=interpolation, align_corners=False, antialias=True)
    else:
        raise UserError(f"CLIP preprocessing: resize_mode={resize_mode!r} is not supported; use 'shortest', "
                        "'longest_pad' or 'squash'")
    mean_t = constant(mean, x)[:, None, None]
    std_t = constant(std, x)[:, None, None]
    return (x - mean_t) / std_t


def unique_rows(items: list[str]) -> tuple[list[str], torch.Tensor]:
    """Distinct items in first-seen order and, per item, its row among them (``(N,)`` long).

    A GRPO batch repeats each prompt G times; encoding each distinct prompt once saves G-1 passes.
    """
    distinct = list(dict.fromkeys(items))
    row = {p: i for i, p in enumerate(distinct)}
    return distinct, torch.tensor([row[p] for p in items], dtype=torch.long)


class OpenCLIP:
    """A frozen open_clip model with its tokenizer and preprocessing, in ``dtype``.

    ``model``: an open_clip architecture name (``"ViT-L-14-quickgelu"``), ``"local-dir:/folder"``
    (``open_clip_config.json`` + weights, open_clip's own format) or ``"hf-hub:org/repo"``.
    ``pretrained``: for a named architecture, a checkpoint file or an open_clip tag (``"openai"``;
    fetched by open_clip, so it must be cached when offline); ignored for ``local-dir:``/``hf-hub:``.
    ``random_init=True`` builds the architecture with random weights and reads no weights at all.
    """

    def __init__(self, who: str, model: str, pretrained: str | None, random_init: bool, dtype: torch.dtype,
                 weights_hint: str = WEIGHTS_HINT):
        import open_clip

        schema = model.split(":", 1)[0] if model.startswith(("local-dir:", "hf-hub:")) else None
        if schema == "local-dir":
            folder = Path(model.split(":", 1)[1])
            if not (folder / "open_clip_config.json").is_file():
                raise UserError(
                    f"{who} reward: model={model!r}: no open_clip_config.json in {folder}; give a folder in"
                    " open_clip's format (open_clip_config.json + open_clip_model.safetensors)"
                )
        elif schema is None:
            if model.replace("/", "-") not in open_clip.list_models():
                raise UserError(
                    f"{who} reward: model={model!r} is not an open_clip architecture; use a name from"
                    " open_clip.list_models(), 'local-dir:<folder>' or 'hf-hub:<repo>'"
                )
            if not random_init:
                if pretrained is None:
                    raise UserError(f"{who} reward: pretrained is not set; give {weights_hint}, or random_init=True")
                looks_like_path = os.sep in pretrained or pretrained.endswith(_WEIGHT_SUFFIXES)
                if looks_like_path and not os.path.isfile(pretrained):
                    raise UserError(f"{who} reward: pretrained={pretrained!r}: no such file; give {weights_hint}")
        try:
            net = open_clip.create_model(
                model,
                pretrained=None if random_init or schema else pretrained,
                load_weights=not random_init,
                require_pretrained=not random_init,
                pretrained_text=False,  # never fetch separate text-tower weights behind the user's back
            )
        except (RuntimeError, OSError, ValueError) as e:
            raise UserError(
                f"{who} reward: could not load open_clip model={model!r} pretrained={pretrained!r} ({e});"
                " offline, give pretrained=<local checkpoint file> or model='local-dir:<folder>', or random_init=True"
            ) from e
        self.model = net.to(dtype).eval().requires_grad_(False)
        self.tokenizer: Callable[[list[str]], torch.Tensor] = open_clip.get_tokenizer(model)
        self.preprocess_cfg = open_clip.get_model_preprocess_cfg(net)
        #: where an odd crop margin puts the crop: open_clip's torchvision CenterCrop rounds (a reward may set it)
        self.crop_offset = "round"
        #: how images reach the model's size (:func:`clip_preprocess`); None: as the model's preprocessing config
        self.resize_mode: str | None = None
        self.dtype = dtype
        #: :data:`PIXELS`; set by :func:`use_pixels`
        self.pixels = "float"
        self._pil_transform: Callable[[object], torch.Tensor] | None = None

    @property
    def embed_dim(self) -> int:
        """Width of the joint embedding space."""
        return int(self.model.visual.output_dim)

    def encode_images(self, images: torch.Tensor, interpolation: str | None = None) -> torch.Tensor:
        """``(B, 3, H, W)`` in [0, 1] → unit-norm embeddings ``(B, D)`` float32, differentiable; resampled as the
        model's preprocessing config says, or with ``interpolation`` when given."""
        cfg = self.preprocess_cfg
        if self.pixels == "pil":
            x = self.pil_pixels(images)
        else:
            x = clip_preprocess(images, cfg["size"], cfg["mean"], cfg["std"],
                                self.resize_mode or cfg.get("resize_mode", "shortest"),
                                interpolation or cfg.get("interpolation", "bicubic"), crop_offset=self.crop_offset)
        return F.normalize(self.model.encode_image(x.to(self.dtype)).float(), dim=-1)

    @torch.no_grad()
    def pil_pixels(self, images: torch.Tensor) -> torch.Tensor:
        """``(B, 3, S, S)`` float32 on ``images``' device: each image rounded to 8 bits, as a PIL image through the
        model's own evaluation transform (``create_model_and_transforms``' second one: PIL's resize, which rounds
        to 8 bits after each pass, the centre crop, ``ToTensor``, the mean and std). No gradient."""
        if self._pil_transform is None:
            from open_clip.transform import PreprocessCfg, image_transform_v2

            self._pil_transform = image_transform_v2(PreprocessCfg(**self.preprocess_cfg), is_train=False)
        return torch.stack([self._pil_transform(to_pil(image)) for image in images]).to(images.device)

    @torch.no_grad()
    def encode_texts(self, prompts: list[str], device: torch.device, batch_size: int) -> torch.Tensor:
        """Unit-norm text embeddings ``(N, D)`` float32 (frozen: no gradient)."""
        tokens = self.tokenizer(prompts).to(device)
        feats = [self.model.encode_text(tokens[i : i + batch_size]) for i in range(0, len(prompts), batch_size)]
        return F.normalize(torch.cat(feats).float(), dim=-1)


def use_pixels(reward: object, who: str, clip: object, pixels: str, crop_offset: str) -> None:
    """Set how ``clip`` (:class:`HFCLIP` or :class:`OpenCLIP`) makes its input (:data:`PIXELS`); ``pil`` crops as
    the model's own preprocessing does (transformers' processor at the floor of half the margin, open_clip's
    ``CenterCrop`` rounding it) and makes ``reward`` non-differentiable (a trainer that needs its gradient
    refuses it)."""
    one_of(f"{who} reward", "pixels", pixels, tuple(PIXELS), PIXELS)
    if pixels == "float":
        return
    own = "floor" if isinstance(clip, HFCLIP) else "round"
    if crop_offset != own:
        raise UserError(f"{who} reward: pixels: pil crops as the model's own preprocessing does (crop_offset: {own}); "
                        f"crop_offset: {crop_offset} needs pixels: float")
    clip.pixels = "pil"  # type: ignore[attr-defined]
    reward.differentiable = False  # type: ignore[attr-defined]


class HFCLIP:
    """A frozen transformers ``CLIPModel`` folder (``config.json`` + weights) with its tokenizer and the
    crop, mean and std of its ``preprocessor_config.json`` (read from ``processor_path``, default the
    folder itself), in ``dtype``; the same interface as :class:`OpenCLIP`. ``random_init=True`` builds
    the architecture of its ``config.json`` with random weights."""

    def __init__(self, who: str, path: Path, processor_path: Path | None, dtype: torch.dtype,
                 random_init: bool = False, option: str = "path"):
        from transformers import AutoTokenizer, CLIPConfig, CLIPImageProcessor, CLIPModel

        try:
            net = CLIPModel(CLIPConfig.from_pretrained(path)) if random_init else CLIPModel.from_pretrained(path)
        except (OSError, ValueError) as e:
            raise UserError(f"{who} reward: {option}={str(path)!r} is not a transformers CLIP folder "
                            f"({str(e).splitlines()[0]}); give the "
                            "downloaded folder (config.json + model.safetensors)") from None
        processor_path = processor_path or path
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(processor_path)
            image_processor = CLIPImageProcessor.from_pretrained(processor_path)
        except (OSError, ValueError) as e:  # ValueError: a folder without tokenizer files
            raise UserError(f"{who} reward: {str(processor_path)!r} has no CLIP tokenizer files or "
                            "preprocessor_config.json; give processor_path: the folder holding them") from None
        self.model = net.to(dtype).eval().requires_grad_(False)
        crop = image_processor.crop_size
        self.size = (crop["height"], crop["width"])
        self.mean, self.std = image_processor.image_mean, image_processor.image_std
        self.max_length = self.model.config.text_config.max_position_embeddings
        # torchvision's rounding, as before; CLIPImageProcessor floors, which a reward asks for (crop_offset)
        self.crop_offset = "round"
        self.processor_path = processor_path
        #: :data:`PIXELS`; set by :func:`use_pixels`
        self.pixels = "float"
        self._pil_processor: object | None = None
        #: how images reach the model's size (:func:`clip_preprocess`); None: CLIPImageProcessor's centre crop
        self.resize_mode: str | None = None
        self.dtype = dtype

    @property
    def embed_dim(self) -> int:
        return int(self.model.config.projection_dim)

    @property
    def logit_scale(self) -> torch.Tensor:
        """``exp(logit_scale)``, the learned temperature (PickScore multiplies its cosine by it)."""
        return self.model.logit_scale.float().exp()

    def encode_images(self, images: torch.Tensor, interpolation: str | None = None) -> torch.Tensor:
        """``(B, 3, H, W)`` in [0, 1] → unit-norm embeddings ``(B, D)`` float32, differentiable; preprocessed as
        ``CLIPImageProcessor`` does (shortest side to the crop, bicubic unless ``interpolation`` is given, centre
        crop placed by ``crop_offset``, normalise). With ``pixels: pil``: :meth:`pil_pixels`, no gradient."""
        if self.pixels == "pil":
            x = self.pil_pixels(images).to(self.dtype)
        else:
            x = clip_preprocess(images, self.size, self.mean, self.std, self.resize_mode or "shortest",
                                interpolation=interpolation or "bicubic", crop_offset=self.crop_offset).to(self.dtype)
        return F.normalize(_features(self.model.get_image_features(pixel_values=x)).float(), dim=-1)

    @torch.no_grad()
    def pil_pixels(self, images: torch.Tensor) -> torch.Tensor:
        """``(B, 3, S, S)`` float32 on ``images``' device: the images rounded to 8 bits and put through
        ``CLIPImageProcessorPil`` (PIL's bicubic resize of the shortest side, which rounds to 8 bits after each
        pass, the crop at the floor of half the margin, the mean and std), what Flow-GRPO's PickScore and
        aesthetic scorers hand their model. No gradient."""
        if self._pil_processor is None:
            from transformers import CLIPImageProcessorPil

            self._pil_processor = CLIPImageProcessorPil.from_pretrained(self.processor_path)
        pictures = [to_pil(image) for image in images]
        return self._pil_processor(images=pictures, return_tensors="pt")["pixel_values"].to(images.device)

    @torch.no_grad()
    def encode_texts(self, prompts: list[str], device: torch.device, batch_size: int) -> torch.Tensor:
        """Unit-norm text embeddings ``(N, D)`` float32 (frozen: no gradient)."""
        # fixed-length padding: an embedding never depends on which prompts share its batch
        tokens = self.tokenizer(prompts, padding="max_length", truncation=True, max_length=self.max_length,
                                return_tensors="pt").to(device)
        feats = [_features(self.model.get_text_features(input_ids=tokens["input_ids"][i : i + batch_size],
                                                        attention_mask=tokens["attention_mask"][i : i + batch_size]))
                 for i in range(0, len(prompts), batch_size)]
        return F.normalize(torch.cat(feats).float(), dim=-1)


def _features(out: torch.Tensor | object) -> torch.Tensor:
    """``get_*_features`` returns a tensor in older transformers and an output with ``pooler_output`` in newer."""
    return out if isinstance(out, torch.Tensor) else out.pooler_output


def load_clip(who: str, path: str | Path | None, *, arch: str, dtype: torch.dtype, download: str,
              option: str = "path", processor_path: str | Path | None = None,
              random_init: bool = False) -> OpenCLIP | HFCLIP:
    """A CLIP model from ``path`` as downloaded: a transformers folder (``config.json``), an open_clip folder
    (``open_clip_config.json``), or an open_clip checkpoint file of the architecture ``arch``."""
    from rewards.model_options import weights_path

    p = weights_path(who, path, download=download, option=option)
    if p.is_file():
        return OpenCLIP(who, arch, str(p), random_init, dtype, weights_hint=download)
    if (p / "open_clip_config.json").is_file():
        return OpenCLIP(who, f"local-dir:{p}", None, random_init, dtype, weights_hint=download)
    if (p / "config.json").is_file():
        proc = weights_path(who, processor_path, download="the CLIP processor folder",
                            option="processor_path") if processor_path is not None else None
        return HFCLIP(who, p, proc, dtype, random_init, option)
    raise UserError(f"{who} reward: {option}={str(p)!r} holds neither config.json (transformers) nor "
                    f"open_clip_config.json (open_clip); give the folder of {download}")


def meta_open_clip(model: str) -> torch.nn.Module:
    """The open_clip model ``model`` (an architecture name or ``local-dir:<folder>``) built on the meta
    device, as :class:`OpenCLIP` builds it but reading no weights; ``hf-hub:`` would be fetched, so it is not
    sized."""
    import open_clip

    if model.startswith("hf-hub:"):
        raise NotSized(f"model={model} names a hub model, which is not fetched to plan: give a local path")
    if model.startswith("local-dir:") and not (Path(model.split(":", 1)[1]) / "open_clip_config.json").is_file():
        raise NotSized(f"model={model} has no open_clip_config.json")
    if not model.startswith("local-dir:") and model.replace("/", "-") not in open_clip.list_models():
        raise NotSized(f"{model} is not an open_clip architecture")
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)  # open_clip's "no pretrained weights loaded": none are meant to be
    try:
        return on_meta(lambda: open_clip.create_model(model, pretrained=None, load_weights=False,
                                                      require_pretrained=False, pretrained_text=False, device="meta"))
    finally:
        logging.disable(previous)


def meta_clip(path: str | Path | None, *, arch: str) -> torch.nn.Module:
    """What :func:`load_clip` loads from ``path``, built on the meta device: an open_clip checkpoint file is
    the architecture ``arch``, an open_clip folder its ``open_clip_config.json``, a transformers folder a
    ``CLIPModel`` of its ``config.json``. A ``path`` that does not exist is sized as ``arch`` where it names a
    checkpoint file (what ``arch`` describes); a folder that does not exist could hold any CLIP, so it is
    not sized (:class:`~flowalign.protocols.NotSized`)."""
    p = existing(path)
    if p is None:
        if path is not None and str(path).endswith(_WEIGHT_SUFFIXES):
            return meta_open_clip(arch)
        raise missing("path", path)
    if p.is_file():
        return meta_open_clip(arch)
    if (p / "open_clip_config.json").is_file():
        return meta_open_clip(f"local-dir:{p}")
    if (p / "config.json").is_file():
        from transformers import CLIPConfig, CLIPModel

        config = CLIPConfig.from_pretrained(p)
        return on_meta(lambda: CLIPModel(config))
    raise NotSized(f"path={path} holds neither config.json nor open_clip_config.json")


def clip_embed_dim(model: torch.nn.Module) -> int:
    """Width of the joint embedding space of an open_clip model or a transformers ``CLIPModel``."""
    config = getattr(model, "config", None)
    return int(config.projection_dim) if config is not None else int(model.visual.output_dim)
