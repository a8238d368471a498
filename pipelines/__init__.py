"""Model families as :class:`flowalign.protocols.FlowPolicy` implementations, loaded by name.

``load(path)`` opens a diffusers pipeline folder (a real checkpoint or a tiny one from :mod:`pipelines.tiny`),
detects its family from ``model_index.json`` and returns the family's policy. One file per family:
``sd3.py`` (SD3 / SD3.5), ``flux.py`` (FLUX.1), ``kontext.py`` (FLUX.1 Kontext, editing), ``flux2.py``
(FLUX.2 dev / klein), ``qwen_image.py`` and ``qwen_image_edit.py``, ``zimage.py`` (Z-Image), ``wan.py``
(Wan 2.1 / 2.2-TI2V) with ``wan22.py`` (Wan 2.2-A14B's two experts) and ``wan_i2v.py`` (Wan 2.2 I2V); shared
peft helpers in ``lora.py``. Editing and image-to-video policies take a per-prompt input image
(``input_images = True``, see :mod:`flowalign.sampling.inputs`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from flowalign.errors import UserError
from flowalign.protocols import FlowPolicy
from pipelines.flux import FluxPolicy
from pipelines.flux2 import Flux2Policy
from pipelines.folder_check import check_model_folder
from pipelines.kontext import KontextPolicy
# what flowalign plan runs on the meta device, and the memory options of load (the core's way in)
from pipelines.memory import CFG_FAMILIES, DEFAULT_SIZE, apply_memory_options, transformer_inputs
from pipelines.qwen_image import QwenImagePolicy
from pipelines.qwen_image_edit import QwenImageEditPolicy
from pipelines.sd3 import SD3Policy
from pipelines.wan import WanPolicy
from pipelines.wan22 import Wan22Policy
from pipelines.wan_i2v import WanI2VPolicy
from pipelines.zimage import ZImagePolicy

__all__ = ["PLUGINS", "FAMILIES", "PIPELINE_FAMILIES", "DTYPES", "load", "detect_family", "parse_dtype",
           "CFG_FAMILIES", "DEFAULT_SIZE", "apply_memory_options", "transformer_inputs"]

#: what this package contributes to the core's plugin tables (:mod:`flowalign.plugins`); the same targets
#: as the ``flowalign.*`` entry points in pyproject.toml
PLUGINS = {"commands": {"tiny": "pipelines.cli.tiny", "pretrain-tiny": "pipelines.pretrain.cli"}}

#: family name → policy class
FAMILIES: dict[str, type] = {
    "sd3": SD3Policy, "flux": FluxPolicy, "wan": WanPolicy, "qwen_image": QwenImagePolicy,
    "flux2": Flux2Policy,
    "zimage": ZImagePolicy,
    "kontext": KontextPolicy,
    "qwen_image_edit": QwenImageEditPolicy,
}
#: diffusers ``model_index.json`` ``_class_name`` → family name
PIPELINE_FAMILIES: dict[str, str] = {
    "StableDiffusion3Pipeline": "sd3",
    "FluxPipeline": "flux",
    "WanPipeline": "wan",
    "WanImageToVideoPipeline": "wan",
    "QwenImagePipeline": "qwen_image",
    "Flux2Pipeline": "flux2",
    "Flux2KleinPipeline": "flux2",
    "ZImagePipeline": "zimage",
    "FluxKontextPipeline": "kontext",
    "QwenImageEditPipeline": "qwen_image_edit",
}
DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}
#: keyword options the policies take besides device / dtype / lora / full_finetune
POLICY_OPTIONS = {"gradient_checkpointing", "defaults", "prompt_cache_size", "decode_batch_size"}
#: options every family takes through :func:`load`, applied to the built policy by :mod:`pipelines.memory`
MEMORY_OPTIONS = {"attention_backend", "offload_text_encoders"}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``"fp32" | "bf16" | "fp16"`` (or the long names, or a ``torch.dtype``) → ``torch.dtype``."""
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise UserError(f"dtype={dtype} is not supported: use one of fp32, bf16, fp16")
        return dtype
    if isinstance(dtype, str) and dtype.lower() in DTYPES:
        return DTYPES[dtype.lower()]
    raise UserError(f"dtype={dtype!r} is not a known dtype: use one of fp32, bf16, fp16")


def detect_family(path: str | Path) -> str:
    """The family of the diffusers folder ``path``, from ``model_index.json``'s ``_class_name``."""
    folder = Path(path)
    if not folder.exists():
        raise UserError(f"path {str(folder)!r} does not exist: pass a diffusers pipeline folder")
    if not folder.is_dir():
        raise UserError(f"path {str(folder)!r} is a file: pass a diffusers pipeline folder (with model_index.json)")
    index = folder / "model_index.json"
    if not index.is_file():
        raise UserError(
            f"path {str(folder)!r} is not a diffusers folder (no model_index.json): pass the folder that "
            "save_pretrained wrote, e.g. a downloaded stabilityai/stable-diffusion-3.5-medium"
        )
    try:
        class_name = json.loads(index.read_text()).get("_class_name")
    except json.JSONDecodeError as err:
        raise UserError(f"{index} is not valid JSON ({err}): re-download or re-save the model") from err
    if class_name not in PIPELINE_FAMILIES:
        known = ", ".join(f"{c} ({f})" for c, f in PIPELINE_FAMILIES.items())
        raise UserError(
            f"family of {str(folder)!r} is unknown: model_index.json names {class_name!r}; known pipelines: {known}"
        )
    return PIPELINE_FAMILIES[class_name]


def _wan_policy_class(path: str | Path) -> type:
    """Wan 2.1 / TI2V (one transformer), Wan 2.2-A14B (``transformer_2``: two experts) or image-to-video."""
    index = json.loads((Path(path) / "model_index.json").read_text())
    if index.get("_class_name") == "WanImageToVideoPipeline":
        return WanI2VPolicy
    entry = index.get("transformer_2")
    return Wan22Policy if entry and entry[0] is not None else WanPolicy


def load(
    path: str | Path,
    family: str | None = None,
    *,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype = torch.float32,
    lora: dict[str, Any] | None = None,
    full_finetune: bool = False,
    **kw: Any,
) -> FlowPolicy:
    """Load the diffusers folder ``path`` as its family's policy.

    ``family``: a key of :data:`FAMILIES` (``"sd3"``, ``"flux"``, ``"wan"``, ``"qwen_image"``, ...), detected
    from ``model_index.json`` when None (and checked against it when given).
    ``dtype``: ``torch.float32`` / ``"fp32"`` on CPU; ``"bf16"`` (or fp16) on GPU.
    ``lora={"rank", "alpha", "target_modules", "dropout", "init"}`` adds a trainable peft LoRA;
    ``full_finetune=True`` trains every transformer weight instead; neither: frozen (sampling/eval).
    ``kw``: ``gradient_checkpointing``, ``defaults`` (sampling defaults over ``flowalign.json``),
    ``prompt_cache_size``, ``decode_batch_size``; ``attention_backend`` and ``offload_text_encoders``
    (every family, see :func:`pipelines.memory.apply_memory_options`).
    """
    torch_dtype = parse_dtype(dtype)
    detected = detect_family(path)
    if family is not None:
        if family not in FAMILIES:
            raise UserError(f"family={family!r} is unknown: known families are {', '.join(sorted(FAMILIES))}")
        if family != detected:
            raise UserError(
                f"family={family!r} but {str(path)!r} holds a {detected!r} pipeline: drop family= or pass {detected!r}"
            )
    unknown = sorted(set(kw) - POLICY_OPTIONS - MEMORY_OPTIONS)
    if unknown:
        raise UserError(f"pipelines.load got unknown option(s) {unknown}: allowed are "
                        f"{sorted(POLICY_OPTIONS | MEMORY_OPTIONS)}")
    check_model_folder(path)  # a missing or damaged part in one line, before diffusers reads it
    memory = {k: kw.pop(k) for k in MEMORY_OPTIONS & set(kw)}
    policy_class = _wan_policy_class(path) if detected == "wan" else FAMILIES[detected]
    policy = policy_class(
        path, device=device, dtype=torch_dtype, lora=lora, full_finetune=full_finetune, **kw
    )
    apply_memory_options(policy, **memory)
    return policy
