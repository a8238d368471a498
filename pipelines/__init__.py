"""Model families as :class:`flowalign.protocols.FlowPolicy` implementations, loaded by name.

``load(path)`` opens a diffusers pipeline folder (a real checkpoint or a tiny one from :mod:`pipelines.tiny`),
detects its family from ``model_index.json`` and returns the family's policy. One file per family, each
declaring its :class:`flowalign.families.FamilySpec` as ``SPEC``: ``sd3.py`` (SD3 / SD3.5), ``flux.py``
(FLUX.1), ``kontext.py`` (FLUX.1 Kontext, editing), ``flux2.py`` (FLUX.2 dev / klein), ``qwen_image.py`` and
``qwen_image_edit.py``, ``zimage.py`` (Z-Image), ``wan.py`` (the Wan family: ``wan_t2v.py``, Wan 2.1 /
2.2-TI2V; ``wan22.py``, Wan 2.2-A14B's two experts; ``wan_i2v.py``, Wan 2.2 I2V), ``hunyuan_video15.py`` (HunyuanVideo 1.5),
``ltx2.py`` (LTX-2, text to video with audio), ``anyflow_far.py`` (AnyFlow-FAR, streaming chunk by chunk with
a KV cache); shared helpers in ``_common.py``, peft helpers in ``lora.py``. Editing and image-to-video policies
take a per-prompt input image (``input_images = True``, see
:mod:`flowalign.sampling.inputs`).

A family is registered by one line in ``PLUGINS["families"]`` below (and the same line in pyproject.toml's
``flowalign.families`` entry points); a family in another package registers through that entry-point group
alone. Nothing here imports a family module until a family is used.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from flowalign import families
from flowalign.errors import UserError
from pipelines.folder_check import check_model_folder, explain_shape_mismatch

if TYPE_CHECKING:
    import torch

    from flowalign.protocols import FlowPolicy

# torch and diffusers are imported by the functions below when called, not here: the core imports this
# package to read PLUGINS (every ``flowalign --help`` does), which must not cost seconds
__all__ = ["PLUGINS", "DTYPE_NAMES", "load", "detect_family", "parse_dtype", "apply_memory_options",
           "transformer_inputs", "compute_in_input_dtype"]

#: what this package contributes to the core's plugin tables (:mod:`flowalign.plugins`); the same targets
#: as the ``flowalign.*`` entry points in pyproject.toml
PLUGINS = {
    "commands": {"tiny": "pipelines.cli.tiny", "pretrain-tiny": "pipelines.pretrain.cli",
                 "causal-wan": "pipelines.cli.causal_wan"},
    #: family name → its spec (:class:`flowalign.families.FamilySpec`)
    "families": {
        "sd3": "pipelines.sd3:SPEC",
        "flux": "pipelines.flux:SPEC",
        "kontext": "pipelines.kontext:SPEC",
        "flux2": "pipelines.flux2:SPEC",
        "qwen_image": "pipelines.qwen_image:SPEC",
        "qwen_image_edit": "pipelines.qwen_image_edit:SPEC",
        "zimage": "pipelines.zimage:SPEC",
        "wan": "pipelines.wan:SPEC",
        "hunyuan_video15": "pipelines.hunyuan_video15:SPEC",
        "ltx2": "pipelines.ltx2:SPEC",
        "anyflow_far": "pipelines.anyflow_far:SPEC",
    },
}

#: the dtype names :func:`parse_dtype` reads → the ``torch`` dtype each stands for
DTYPE_NAMES = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16",
               "fp16": "float16", "float16": "float16"}
#: keyword options the policies take besides device / dtype / lora / full_finetune
POLICY_OPTIONS = {"gradient_checkpointing", "defaults", "prompt_cache_size", "decode_batch_size"}
#: options every family takes through :func:`load`, applied to the built policy by :mod:`pipelines.memory`
MEMORY_OPTIONS = {"attention_backend", "offload_text_encoders", "compile"}


def __getattr__(name: str) -> Any:
    # ``pipelines.FAMILIES`` (family name → policy class) imports every family: built on first use only
    if name == "FAMILIES":
        return {n: spec.policy for n, spec in families.registry().items()}
    raise AttributeError(f"module 'pipelines' has no attribute {name!r}")


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``"fp32" | "bf16" | "fp16"`` (or the long names, or a ``torch.dtype``) → ``torch.dtype``."""
    import torch

    if isinstance(dtype, torch.dtype):
        if dtype not in {getattr(torch, name) for name in DTYPE_NAMES.values()}:
            raise UserError(f"dtype={dtype} is not supported: use one of fp32, bf16, fp16")
        return dtype
    if isinstance(dtype, str) and dtype.lower() in DTYPE_NAMES:
        return getattr(torch, DTYPE_NAMES[dtype.lower()])
    raise UserError(f"dtype={dtype!r} is not a known dtype: use one of fp32, bf16, fp16")


def detect_family(path: str | Path) -> str:
    """The family of the diffusers folder ``path``, from ``model_index.json``'s ``_class_name``."""
    return families.detect(path).name


def load(
    path: str | Path,
    family: str | None = None,
    *,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype = "fp32",
    lora: dict[str, Any] | None = None,
    full_finetune: bool = False,
    **kw: Any,
) -> FlowPolicy:
    """Load the diffusers folder ``path`` as its family's policy.

    ``family``: a registered family name (``"sd3"``, ``"flux"``, ``"wan"``, ``"qwen_image"``, ...), detected
    from ``model_index.json`` when None (and checked against it when given).
    ``dtype``: ``"fp32"`` / ``torch.float32`` on CPU; ``"bf16"`` (or fp16) on GPU.
    ``lora={"rank", "alpha", "target_modules", "dropout", "init"}`` adds a trainable peft LoRA;
    ``full_finetune=True`` trains every transformer weight instead; neither: frozen (sampling/eval).
    ``kw``: ``gradient_checkpointing``, ``defaults`` (sampling defaults over ``flowalign.json``),
    ``prompt_cache_size``, ``decode_batch_size``; ``attention_backend``, ``offload_text_encoders`` and ``compile``
    (every family, see :func:`pipelines.memory.apply_memory_options`).
    """
    torch_dtype = parse_dtype(dtype)
    spec = families.detect(path)
    if family is not None and families.get(family).name != spec.name:
        raise UserError(f"family={family!r} but {str(path)!r} holds a {spec.name!r} pipeline: drop family= or pass "
                        f"{spec.name!r}")
    unknown = sorted(set(kw) - POLICY_OPTIONS - MEMORY_OPTIONS)
    if unknown:
        raise UserError(f"pipelines.load got unknown option(s) {unknown}: allowed are "
                        f"{sorted(POLICY_OPTIONS | MEMORY_OPTIONS)}")
    check_model_folder(path)  # a missing or damaged part in one line, before diffusers reads it
    memory = {k: kw.pop(k) for k in MEMORY_OPTIONS & set(kw)}
    policy_class = spec.policy_class(families.read_index(path))
    check_defaults(path, kw.get("defaults"))
    try:
        policy = policy_class(path, device=device, dtype=torch_dtype, lora=lora, full_finetune=full_finetune, **kw)
    except ValueError as err:
        line = explain_shape_mismatch(path, err)  # a config.json whose sizes are not its weights'
        if line is None:
            raise
        raise UserError(line) from None
    apply_memory_options(policy, **memory)
    return policy


def check_defaults(path: str | Path, defaults: dict[str, Any] | None) -> None:
    """Refuse a ``model.defaults`` key the folder's family does not read, naming it (imports the family's code,
    loads no weights: what ``flowalign train --check`` runs)."""
    from pipelines._common import check_sampling_defaults

    spec = families.detect(path)
    check_sampling_defaults(spec.policy_class(families.read_index(path)), path, defaults, spec.name)


# The core's way into what the families share: flowalign plan runs the transformer on the meta device with
# these inputs and the LoRA's compute dtype; load applies the memory options. Each imports its module
# (torch, diffusers, peft) when called.
def transformer_inputs(family: str, config: Any, batch: int, size: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
    """:func:`pipelines.memory.transformer_inputs` (``device``, ``dtype`` as keywords)."""
    from pipelines.memory import transformer_inputs as inputs

    return inputs(family, config, batch, size, **kwargs)


def apply_memory_options(policy: Any, **options: Any) -> None:
    """:func:`pipelines.memory.apply_memory_options`: the options of :data:`MEMORY_OPTIONS` on a built policy."""
    from pipelines.memory import apply_memory_options as apply

    apply(policy, **options)


def compute_in_input_dtype(transformer: torch.nn.Module, on: bool = True) -> int:
    """:func:`pipelines.lora.compute_in_input_dtype`: the LoRA of ``transformer`` computed in its input's dtype."""
    from pipelines.lora import compute_in_input_dtype as compute

    return compute(transformer, on)
