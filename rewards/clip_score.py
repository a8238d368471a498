"""The ``clip_score`` reward: cosine similarity of CLIP image and prompt embeddings."""

from __future__ import annotations

from typing import Any

import torch

from flowalign.errors import UserError
from rewards.clip_common import CROP_OFFSET_MEANINGS, OpenCLIP, load_clip, meta_clip, meta_open_clip, unique_rows
from rewards.clip_common import use_pixels
from rewards.common import EmbeddingReward
from rewards.model_options import deprecated, one_of
from rewards.registry import register


#: what the text encoder reads of a prompt: as given, or as FAV's HPSv2 scorer wraps it (their
#: ``rewards/hpsv2.py``: "a photo of a " and the prompt up to its first comma, stripped)
PROMPT_FORMS = {"as_given": lambda prompt: prompt,
                "photo_of_first_clause": lambda prompt: f"a photo of a {prompt.split(',')[0].strip()}"}
#: how images are resampled to the model's input: as the model's preprocessing config says (``model``: open_clip's
#: and CLIPImageProcessor's bicubic), or ``bilinear`` as FAV's HPSv2 scorer (torchvision ``Resize(224,
#: antialias=True)``, bilinear by default); both antialiased, shortest side first
INTERPOLATIONS = ("model", "bicubic", "bilinear")
#: the score's form: name → divisor of ``exp(logit_scale)·cos`` (``None``: the bare cosine). ``flow_grpo`` is
#: Flow-GRPO's ClipScorer, ``logits_per_image / 30``
CLIP_FORMS: dict[str, float | None] = {"cosine": None, "flow_grpo": 30.0}
#: where an odd margin puts the centre crop: ``round`` as torchvision's CenterCrop (open_clip's, and Flow-GRPO's
#: ClipScorer, a torchvision transform), ``floor`` as transformers' CLIPImageProcessor
CROP_OFFSETS = ("round", "floor")
#: how an image reaches the model's (square) size: ``model``, as its preprocessing config says (CLIP's shortest side
#: and centre crop); ``crop``, that explicitly; ``pad``, the longest side and zeros around (the hpsv2 scorer's)
RESIZES = {"model": None, "crop": "shortest", "pad": "longest_pad"}


@register("clip_score")
class CLIPScore(EmbeddingReward):
    """``score_i = cos(E_img(x_i), E_txt(prompt_i))`` in [-1, 1] with a CLIP model.

    Options: ``path`` (the downloaded weights: a transformers CLIP folder such as
    ``openai/clip-vit-large-patch14``, an open_clip folder with ``open_clip_config.json``, or an open_clip
    checkpoint file of the architecture ``arch``, default ``ViT-L-14-quickgelu``), ``processor_path`` (a
    transformers folder's tokenizer and preprocessor config, when not inside ``path``), ``random_init``
    (the architecture with random weights), ``prompt_form`` (what the text encoder reads: ``as_given``, or
    ``photo_of_first_clause``, "a photo of a {the prompt up to its first comma}", as FAV's HPSv2 scorer wraps
    it), ``interpolation`` (how images are resampled to the model's input size: ``model``, its preprocessing
    config's, bicubic for CLIP; ``bicubic``; or ``bilinear``, as FAV's HPSv2 scorer), ``form`` (``cosine``, the
    default; ``flow_grpo``: ``exp(logit_scale)·cos / 30`` on images resampled bilinear unless ``interpolation``
    names another, Flow-GRPO's ClipScorer), ``crop_offset`` (``round``, default, as torchvision's
    ``CenterCrop``; ``floor`` as transformers' ``CLIPImageProcessor``), ``resize`` (``model``, the default here:
    the model's shortest side and centre crop; ``crop`` the same explicitly; ``pad``: the longest side and zeros
    around it, as the hpsv2 scorer; equal on square images), plus ``batch_size``, ``device``, ``dtype``. Deprecated:
    ``model`` (architecture, ``local-dir:`` or ``hf-hub:``) and ``pretrained`` (file or open_clip tag).
    Differentiable in the samples.
    """

    name = "clip_score"
    #: what to download, as the missing-path line says it
    download = "a CLIP model (e.g. openai/clip-vit-large-patch14)"
    default_arch = "ViT-L-14-quickgelu"
    #: the forms this reward offers (``hps`` is the cosine only, as the hpsv2 package scores it)
    forms: tuple[str, ...] = tuple(CLIP_FORMS)
    #: ``resize``'s default (``hps``: ``pad``, as the hpsv2 scorer)
    default_resize = "model"

    def __init__(self, path: str | None = None, *, arch: str | None = None, processor_path: str | None = None,
                 model: str | None = None, pretrained: str | None = None, random_init: bool = False,
                 prompt_form: str = "as_given", interpolation: str = "model", form: str = "cosine",
                 crop_offset: str = "round", resize: str | None = None, pixels: str = "float", **options: Any):
        super().__init__(**options)
        resize = self.default_resize if resize is None else resize
        label = f"{self.name} reward"
        one_of(label, "resize", resize, RESIZES)
        one_of(label, "form", form, self.forms)
        one_of(label, "crop_offset", crop_offset, CROP_OFFSETS, CROP_OFFSET_MEANINGS)
        one_of(label, "prompt_form", prompt_form, PROMPT_FORMS)
        one_of(label, "interpolation", interpolation, INTERPOLATIONS)
        self.prompt_form = prompt_form
        self.interpolation = None if interpolation == "model" else interpolation
        if form == "flow_grpo" and self.interpolation is None:
            # their ClipScorer resizes float tensors with torchvision's Resize, bilinear by default
            self.interpolation = "bilinear"
        self.divisor = CLIP_FORMS[form]
        self.clip: Any
        if path is None and random_init and model is None:  # an open_clip architecture, nothing read
            self.clip = OpenCLIP(self.name, arch or self.default_arch, None, True, self.dtype, self.download)
        elif model is not None or pretrained is not None:  # the open_clip options of earlier versions
            for old, value in (("model", model), ("pretrained", pretrained)):
                if value is not None:
                    deprecated(self.name, old, "path: (the downloaded folder or checkpoint file) and arch:")
            self.clip = OpenCLIP(self.name, model or arch or self.default_arch, pretrained, random_init,
                                      self.dtype, self.download)
        else:
            self.clip = load_clip(self.name, path, arch=arch or self.default_arch, dtype=self.dtype,
                                  download=self.download, processor_path=processor_path, random_init=random_init)
        self.clip.crop_offset = crop_offset
        self.clip.resize_mode = RESIZES[resize]
        if pixels == "pil" and (self.interpolation is not None or resize != "model"):
            raise UserError(f"{label}: pixels: pil resizes as the model's own preprocessing does; it takes "
                            f"interpolation: model and resize: model (form: flow_grpo resamples bilinear on floats)")
        use_pixels(self, self.name, self.clip, pixels, crop_offset)

    def modules(self) -> list[torch.nn.Module]:
        return [self.clip.model]

    @classmethod
    def planned_modules(cls, options: dict[str, Any]) -> list[torch.nn.Module]:
        """The CLIP of ``options`` on the meta device, chosen as ``__init__`` chooses it (a checkpoint file
        that does not exist yet is sized as ``arch``)."""
        arch = options.get("arch") or cls.default_arch
        model, path = options.get("model"), options.get("path")
        if model is not None or options.get("pretrained") is not None:
            return [meta_open_clip(model or arch)]
        if path is None and options.get("random_init"):
            return [meta_open_clip(arch)]
        return [meta_clip(path, arch=arch)]

    def context(self, prompts: list[str], metadata: list[dict[str, Any]], samples: torch.Tensor,
                device: torch.device) -> tuple[torch.Tensor, ...]:
        """Text embeddings ``(B, D)``, one encoder pass per distinct prompt."""
        distinct, rows = unique_rows([PROMPT_FORMS[self.prompt_form](p) for p in prompts])
        return (self.clip.encode_texts(distinct, device, self.batch_size)[rows.to(device)],)

    def embed(self, images: torch.Tensor) -> torch.Tensor:
        """Unit-norm CLIP image embeddings ``(b, D)``."""
        return self.clip.encode_images(images, self.interpolation)

    def score_features(self, features: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        cosine = (features * text).sum(-1)
        if self.divisor is None:
            return cosine
        # exp(logit_scale): a transformers CLIPModel's and an open_clip CLIP's learned temperature alike
        return self.clip.model.logit_scale.float().exp() * cosine / self.divisor
