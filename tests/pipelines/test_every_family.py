"""The properties every trainable family must have, one test each, parametrized over the families' tiny twins:
a stored SDE transition re-evaluates to probability ratio 1, two optimiser steps with LoRA and with full
fine-tuning move the trained weights (and only those), the saved LoRA loads with diffusers and gives our
velocity, and the published configs have the published sizes on the meta device.

A family joins by a row in ``FAMILIES`` (and its release in ``PUBLISHED_SIZES``); what only one family does stays
in its own ``test_<family>.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from pipelines.wan22 import LORA_WEIGHT_NAME_2
from tests.pipelines import family_checks as checks

#: one prompt, two samples: the smallest batch that still has a group, for the video families whose checks are
#: slow (HunyuanVideo 1.5's text streams are 2,000 tokens long, the pipeline's fixed lengths)
SMALL = ("trainer.prompts_per_step=1", "trainer.group_size=2", "trainer.batch_size=2")
#: six steps: the Wan 2.2 twins' trained transitions then fall on both sides of the expert boundary (σ = 0.875,
#: 0.9 for I2V), more than one on each
BOTH_EXPERTS = ("trainer.num_steps=6",)


def load_into_both_experts(pipe, adapter: Path) -> None:
    """Wan 2.2 writes one LoRA file per expert; diffusers reads the low-noise expert's with its own flag."""
    pipe.load_lora_weights(str(adapter))
    pipe.load_lora_weights(str(adapter), weight_name=LORA_WEIGHT_NAME_2, load_into_transformer_2=True)


def load_into_transformer(pipe, adapter: Path) -> None:
    """HunyuanVideo15Pipeline has no load_lora_weights: diffusers loads a LoRA into the transformer itself."""
    pipe.transformer.load_lora_adapter(str(adapter), weight_name="pytorch_lora_weights.safetensors")


@dataclass(frozen=True)
class Family:
    #: the tiny twin (``pipelines.tiny``) and its overrides
    twin: str
    overrides: dict = field(default_factory=dict)
    #: trainer overrides the family's checks need
    trainer: tuple[str, ...] = ()
    #: the input images of an image-conditioned family (its training prompts then come from a JSONL with images)
    inputs: Callable[[], list] | None = None
    #: how a diffusers user loads the saved LoRA; None: ``pipe.load_lora_weights(folder)``
    load_lora: Callable | None = None
    #: whether full fine-tuning is checked too
    full: bool = True


FAMILIES = {
    "flux2": Family("flux2"),
    # full fine-tuning of this folder trains the same transformer as the flux2 row's
    "flux2_edit": Family("flux2", {"sampling": {"reference_images": 1}}, inputs=checks.reference_images, full=False),
    "qwen_image": Family("qwen_image"),
    "qwen_image_edit": Family("qwen_image_edit", inputs=checks.edit_inputs),
    "zimage": Family("zimage"),
    "kontext": Family("kontext", inputs=checks.edit_inputs),
    "hunyuan_video15": Family("hunyuan_video15", trainer=SMALL, load_lora=load_into_transformer),
    "ltx2": Family("ltx2", trainer=SMALL),  # LTX2Pipeline's own load_lora_weights (LTX2LoraLoaderMixin)
    "wan22": Family("wan22", trainer=BOTH_EXPERTS, load_lora=load_into_both_experts),
    "wan_i2v": Family("wan_i2v", trainer=BOTH_EXPERTS, inputs=lambda: [checks.first_frame(), checks.first_frame()],
                      load_lora=load_into_both_experts),
}

#: the releases whose published configs (assets/architectures) are sized on the meta device; HunyuanVideo 1.5
#: and LTX-2 count several components and check theirs in their own files
PUBLISHED_SIZES = ["flux2_dev", "flux2_klein_4b", "flux2_klein_9b", "qwen_image", "zimage", "wan22_a14b_expert",
                   "wan22_ti2v_5b", "wan22_i2v_a14b_expert"]


@pytest.fixture
def family(request, tiny_model_dir) -> tuple[Family, Path]:
    spec = FAMILIES[request.param]
    return spec, tiny_model_dir(spec.twin, **spec.overrides)


@pytest.mark.parametrize("family", list(FAMILIES), indirect=True)
def test_stored_transitions_reevaluate_to_ratio_one(family, tmp_path):
    spec, folder = family
    checks.check_ratio_one(folder, tmp_path, *spec.trainer, images=spec.inputs is not None)


@pytest.mark.parametrize("family, finetune", [
    pytest.param(name, finetune, id=f"{name}-{finetune}")
    for name, spec in FAMILIES.items() for finetune in (["lora", "full"] if spec.full else ["lora"])
], indirect=["family"])
def test_two_training_steps_move_the_trained_weights(family, finetune, tmp_path):
    spec, folder = family
    checks.check_two_training_steps(folder, tmp_path, finetune, *spec.trainer, images=spec.inputs is not None)


@pytest.mark.parametrize("family", list(FAMILIES), indirect=True)
def test_saved_lora_loads_with_diffusers(family, tmp_path):
    spec, folder = family
    checks.check_lora_loads_with_diffusers(folder, tmp_path, load_into_pipe=spec.load_lora,
                                           images=None if spec.inputs is None else spec.inputs())


@pytest.mark.parametrize("name", PUBLISHED_SIZES)
def test_published_sizes_on_the_meta_device(name):
    checks.check_meta_size(name)
