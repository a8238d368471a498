"""Tiny Qwen-Image-Edit twin: the tiny Qwen-Image components plus the ``Qwen2VLProcessor`` through which the
VL encoder reads the input image (its image processor sized for the tiny vision tower)."""

from __future__ import annotations

from typing import Any

from pipelines.tiny_twins.qwen_image import SAMPLING as _T2I

#: Qwen-Image-Edit's model card: true CFG 4.0 with the negative " ", 50 steps; the condition area shrunk
#: from the pipeline's 1024² to the tiny model's 32² (``edit_image_area``)
SAMPLING: dict[str, Any] = {**_T2I, "edit_image_area": 32 * 32}
#: Qwen2-VL's patching (14 px patches, 2×2 merge, 2 frames) over at most 112² px for the tiny tower
PROCESSOR = {"min_pixels": 56 * 56, "max_pixels": 112 * 112, "patch_size": 14, "merge_size": 2,
             "temporal_patch_size": 2}


def build(**overrides):
    """A tiny ``QwenImageEditPipeline`` (same overrides as the Qwen-Image twin)."""
    from diffusers import QwenImageEditPipeline
    from transformers import Qwen2VLImageProcessor, Qwen2VLProcessor, Qwen2VLVideoProcessor

    from pipelines.tiny_twins.qwen_image import build as build_qwen_image

    base = build_qwen_image(**overrides)
    processor = Qwen2VLProcessor(image_processor=Qwen2VLImageProcessor(**PROCESSOR), tokenizer=base.tokenizer,
                                 video_processor=Qwen2VLVideoProcessor(**PROCESSOR))
    pipe = QwenImageEditPipeline(scheduler=base.scheduler, vae=base.vae, text_encoder=base.text_encoder,
                                 tokenizer=base.tokenizer, processor=processor, transformer=base.transformer)
    pipe.set_progress_bar_config(disable=True)
    return pipe
