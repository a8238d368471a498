"""Human-preference rewards built on CLIP: ``pickscore`` (PickScore v1) and ``hps`` (HPS v2 / v2.1)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from flowalign.errors import UserError
from rewards.clip_common import clip_preprocess, unique_rows
from rewards.clip_score import CLIPScore
from rewards.common import BatchedImageReward
from rewards.registry import register


@register("hps")
class HPSScore(CLIPScore):
    """HPS v2 score: the cosine similarity of an open_clip ViT-H/14 fine-tuned on human preferences.

    HPS's score is exactly CLIP score with other weights, so only the defaults differ:
    ``pretrained`` is the HPS checkpoint file (``HPS_v2.1_compressed.pt`` or ``HPS_v2_compressed.pt``;
    no open_clip tag exists for it). Other options as :class:`~rewards.clip_score.CLIPScore`.
    """

    name = "hps"
    weights_hint = "the HPS checkpoint file (HPS_v2.1_compressed.pt)"

    def __init__(self, model: str = "ViT-H-14", pretrained: str | None = None, **options: Any):
        super().__init__(model, pretrained, **options)


@register("pickscore")
class PickScore(BatchedImageReward):
    """PickScore: ``score_i = exp(logit_scale) · cos(E_img(x_i), E_txt(prompt_i))`` (about 15-25 for real images).

    A transformers ``CLIPModel``. Options: ``model`` (folder or hub id of the model,
    default ``yuvalkirstain/PickScore_v1``), ``processor`` (folder or hub id holding the tokenizer
    and ``preprocessor_config.json``; default PickScore's, ``laion/CLIP-ViT-H-14-laion2B-s32B-b79K``),
    ``random_init`` (the model's architecture from its ``config.json`` with random weights),
    ``batch_size``, ``device``, ``dtype``. Hub ids only work where the hub cache already holds them.
    Differentiable in the samples.
    """

    name = "pickscore"

    def __init__(self, model: str = "yuvalkirstain/PickScore_v1",
                 processor: str = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K", *, random_init: bool = False,
                 **options: Any):
        super().__init__(**options)
        from transformers import AutoTokenizer, CLIPConfig, CLIPImageProcessor, CLIPModel

        try:
            if random_init:
                net = CLIPModel(CLIPConfig.from_pretrained(model))
            else:
                net = CLIPModel.from_pretrained(model)
        except OSError as e:
            raise UserError(
                f"pickscore reward: could not load model={model!r} ({e}); give the local folder of"
                " PickScore_v1 (config.json + weights), or random_init=True with a folder holding its config.json"
            ) from e
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(processor)
            image_processor = CLIPImageProcessor.from_pretrained(processor)
        except (OSError, ValueError) as e:  # ValueError: a folder without tokenizer files
            raise UserError(
                f"pickscore reward: could not load processor={processor!r} ({e}); give a local folder with"
                " the CLIP tokenizer files and preprocessor_config.json"
            ) from e
        self.model = net.to(self.dtype).eval().requires_grad_(False)
        crop = image_processor.crop_size
        self.size = (crop["height"], crop["width"])
        self.mean, self.std = image_processor.image_mean, image_processor.image_std
        self.max_length = self.model.config.text_config.max_position_embeddings

    def modules(self) -> list[torch.nn.Module]:
        return [self.model]

    @torch.no_grad()
    def context(self, prompts: list[str], metadata: list[dict[str, Any]], samples: torch.Tensor,
                device: torch.device) -> tuple[torch.Tensor, ...]:
        """Unit-norm text embeddings ``(B, D)``, one encoder pass per distinct prompt."""
        distinct, rows = unique_rows(prompts)
        # fixed-length padding: an embedding never depends on which prompts share its batch
        tokens = self.tokenizer(distinct, padding="max_length", truncation=True, max_length=self.max_length,
                                return_tensors="pt").to(device)
        feats = torch.cat([
            self.model.get_text_features(input_ids=tokens["input_ids"][i : i + self.batch_size],
                                         attention_mask=tokens["attention_mask"][i : i + self.batch_size]).pooler_output
            for i in range(0, len(distinct), self.batch_size)
        ])
        return (F.normalize(feats.float(), dim=-1)[rows.to(device)],)

    def score_batch(self, images: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        # as CLIPImageProcessor: shortest side to the crop size (CLIP processors resize to it), bicubic,
        # centre crop, normalise
        x = clip_preprocess(images, self.size, self.mean, self.std).to(self.dtype)
        image = F.normalize(self.model.get_image_features(pixel_values=x).pooler_output.float(), dim=-1)
        return self.model.logit_scale.float().exp() * (image * text).sum(-1)
