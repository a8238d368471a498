"""Human-preference rewards built on CLIP: ``pickscore`` (PickScore v1) and ``hps`` (HPS v2 / v2.1)."""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from flowalign.errors import UserError
from flowalign.protocols import NotSized
from rewards.clip_common import CROP_OFFSET_MEANINGS, HFCLIP, unique_rows, use_pixels
from rewards.clip_score import CLIPScore
from rewards.common import EmbeddingReward
from rewards.model_options import deprecated, one_of, weights_path
from rewards.planning import existing, on_meta, published
from rewards.registry import register


@register("hps")
class HPSScore(CLIPScore):
    """HPS v2 score: ``cos(E_img(x_i), E_txt(prompt_i))`` of an open_clip ViT-H/14 fine-tuned on human
    preferences (as the ``hpsv2`` package scores it; about 0.2-0.35 for real images).

    HPS's score is exactly CLIP score with other weights, so only the defaults differ: ``path`` is the HPS
    checkpoint file (``HPS_v2.1_compressed.pt`` or ``HPS_v2_compressed.pt`` from xswu/HPSv2) of the
    architecture ``arch`` (default ``ViT-H-14``), and images reach the model's size as the hpsv2 scorer's
    ``preprocess_val`` takes them, the longest side resized and zeros around (``resize: pad``; ``crop``, CLIP's
    centre crop, is the former form; the two agree on square images). Other options as
    :class:`~rewards.clip_score.CLIPScore`.
    """

    name = "hps"
    download = "HPS_v2.1_compressed.pt (xswu/HPSv2)"
    default_arch = "ViT-H-14"
    forms = ("cosine",)
    default_resize = "pad"
    #: runs saved without ``resize`` computed CLIP's centre crop (the former default; rewards.registry.former_forms)
    before: ClassVar[dict[str, Any]] = {"resize": "crop"}


#: the published architecture PickScore_v1 is (assets/reward_architectures/): CLIP ViT-H/14
PICKSCORE_ARCHITECTURE = "clip-vit-h-14"
#: PickScore's score forms: name → divisor of ``exp(logit_scale)·cos`` (``None``: the bare cosine)
PICKSCORE_FORMS: dict[str, float | None] = {"flow_grpo": 26.0, "logit": 1.0, "cosine": None}
#: where an odd margin puts the centre crop: ``floor`` as transformers' CLIPImageProcessor (PickScore's processor,
#: so Flow-GRPO's scorer), ``round`` as torchvision's CenterCrop (flowalign's earlier form)
CROP_OFFSETS = ("floor", "round")


@register("pickscore")
class PickScore(EmbeddingReward):
    """PickScore, in one of three forms (``form:``), with ``c_i = cos(E_img(x_i), E_txt(prompt_i))``:

    - ``flow_grpo`` (default): ``exp(logit_scale)·c_i / 26``, about 0.6-0.9 (Flow-GRPO's scorer);
    - ``logit``: ``exp(logit_scale)·c_i``, about 15-25 (the PickScore paper's score);
    - ``cosine``: ``c_i`` (DanceGRPO's form).

    ``scale`` (a positive number) sets the divisor of ``exp(logit_scale)·c_i`` itself: ``scale: 26`` is the
    ``flow_grpo`` form, ``scale: 1`` the ``logit`` form; it is refused beside ``form: cosine``.

    Images are preprocessed as PickScore's ``CLIPImageProcessor`` does (shortest side to 224, bicubic, centre
    crop, CLIP's mean and std), in torch: ``crop_offset: floor`` (default) places the crop of an odd margin as the
    processor does, ``round`` half a pixel further, as torchvision's ``CenterCrop`` (the earlier form). Flow-GRPO's
    scorer reads 8-bit images through PIL; the float path here differs from it by that rounding only
    (docs/methods/flow_grpo.md, "The reward models against Flow-GRPO's scorers"); ``pixels: pil`` reads them as
    it does (the processor's PIL backend on the 8-bit images), without a gradient.

    A transformers ``CLIPModel``. Options: ``path`` (the downloaded ``yuvalkirstain/PickScore_v1`` folder),
    ``processor_path`` (the folder with the tokenizer and ``preprocessor_config.json`` when ``path`` lacks them:
    ``laion/CLIP-ViT-H-14-laion2B-s32B-b79K``), ``form``, ``random_init`` (the architecture of ``path``'s
    ``config.json`` with random weights), ``scale``, ``crop_offset``, ``pixels`` (``float``, default, or ``pil``),
    ``batch_size``, ``device``, ``dtype``. Deprecated: ``model``
    (→ ``path``), ``processor`` (→ ``processor_path``). Differentiable in the samples (with ``pixels: float``).
    """

    name = "pickscore"
    download = "yuvalkirstain/PickScore_v1 (the model folder)"
    #: runs saved without ``crop_offset`` cropped as torchvision rounds (the former default;
    #: rewards.registry.former_forms)
    before: ClassVar[dict[str, Any]] = {"crop_offset": "round"}

    def __init__(self, path: str | None = None, *, processor_path: str | None = None, form: str = "flow_grpo",
                 scale: float | None = None, model: str | None = None, processor: str | None = None,
                 random_init: bool = False, crop_offset: str = "floor", pixels: str = "float", **options: Any):
        super().__init__(**options)
        one_of("pickscore reward", "crop_offset", crop_offset, CROP_OFFSETS, CROP_OFFSET_MEANINGS)
        one_of("pickscore reward", "form", form, PICKSCORE_FORMS)
        if scale is not None:
            if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 < scale < float("inf"):
                raise UserError(f"pickscore reward: scale={scale!r} must be a positive number "
                                "(26: Flow-GRPO's divisor; 1: the paper's logit)")
            if form == "cosine":
                raise UserError("pickscore reward: scale divides exp(logit_scale)·cos, which form: cosine does not use; "
                                "remove scale or form")
        if model is not None:
            deprecated(self.name, "model", "path:")
            path = path or model
        if processor is not None:
            deprecated(self.name, "processor", "processor_path:")
            processor_path = processor_path or processor
        folder = weights_path(self.name, path, download=self.download, kind="folder")
        proc = None if processor_path is None else weights_path(
            self.name, processor_path, download="laion/CLIP-ViT-H-14-laion2B-s32B-b79K (its processor files)",
            option="processor_path", kind="folder")
        self.clip = HFCLIP(self.name, folder, proc, self.dtype, random_init)
        self.clip.crop_offset = crop_offset
        use_pixels(self, self.name, self.clip, pixels, crop_offset)
        self.model = self.clip.model
        self.divisor = PICKSCORE_FORMS[form] if scale is None else float(scale)

    def modules(self) -> list[torch.nn.Module]:
        return [self.model]

    @classmethod
    def planned_modules(cls, options: dict[str, Any]) -> list[torch.nn.Module]:
        """The ``CLIPModel`` of ``path``'s ``config.json`` on the meta device; where ``path`` does not exist,
        PickScore_v1's own (CLIP ViT-H/14, from ``assets/reward_architectures/clip-vit-h-14``)."""
        from transformers import CLIPConfig, CLIPModel

        folder = existing(options.get("path") or options.get("model")) or published(PICKSCORE_ARCHITECTURE)
        if not (folder / "config.json").is_file():
            raise NotSized(f"path={folder} has no config.json")
        config = CLIPConfig.from_pretrained(folder)
        return [on_meta(lambda: CLIPModel(config))]

    def context(self, prompts: list[str], metadata: list[dict[str, Any]], samples: torch.Tensor,
                device: torch.device) -> tuple[torch.Tensor, ...]:
        """Unit-norm text embeddings ``(B, D)``, one encoder pass per distinct prompt."""
        distinct, rows = unique_rows(prompts)
        return (self.clip.encode_texts(distinct, device, self.batch_size)[rows.to(device)],)

    def embed(self, images: torch.Tensor) -> torch.Tensor:
        """Unit-norm CLIP image embeddings ``(b, D)``."""
        return self.clip.encode_images(images)

    def score_features(self, features: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        cosine = (features * text).sum(-1)
        return cosine if self.divisor is None else self.clip.logit_scale * cosine / self.divisor
