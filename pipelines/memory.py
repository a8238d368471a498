"""Memory and speed controls that know the model side: the transformer's inputs for a batch at a
resolution (what ``flowalign plan`` runs on the meta device to count activations: each family's
``transformer_inputs``, declared in its spec), the attention backend of diffusers' dispatcher
(``model.attention_backend``) and ``torch.compile`` of the transformer's blocks (``model.compile``).
"""

from __future__ import annotations

from typing import Any

import torch

from flowalign import families
from flowalign.errors import UserError
from flowalign.parallel import block_modules


def transformer_inputs(family: str, config: Any, batch: int, size: dict[str, Any], *,
                       device: str | torch.device = "meta", dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """Keyword inputs of the family's transformer for ``batch`` samples at ``size`` (height, width,
    num_frames, max_sequence_length; a missing or null one is the family's default), as its policy passes them."""
    spec = families.get(family)
    merged = {**spec.size, **{k: v for k, v in size.items() if v is not None}}
    return spec.transformer_inputs(config, batch, merged, device=device, dtype=dtype)


#: ``model.attention_backend`` → the package diffusers' attention dispatcher needs for it
ATTENTION_BACKENDS = {"native": None, "flash": "flash-attn", "_flash_3": "flash-attn 3 (flash_attn_interface)",
                      "sage": "sageattention", "xformers": "xformers",
                      # torch SDPA with one kernel pinned (native lets SDPA choose): cuDNN's, flash's, memory-efficient
                      "_native_cudnn": None, "_native_flash": None, "_native_efficient": None}


def set_attention_backend(transformer: torch.nn.Module, backend: str, device: str | torch.device) -> None:
    """Route the transformer's attention through diffusers' dispatcher to ``backend``.

    ``native`` (torch SDPA) is diffusers' default and changes nothing. ``_native_cudnn``, ``_native_flash``
    and ``_native_efficient`` pin one of SDPA's own CUDA kernels; the others are CUDA kernels from separate
    packages (``xformers`` is the ``gpu`` extra). A missing package or a non-CUDA device is a one-line error,
    not a failure at the first forward.
    """
    if backend == "native":
        return
    if backend not in ATTENTION_BACKENDS:
        raise UserError(f"model.attention_backend={backend!r} is unknown: use one of {', '.join(ATTENTION_BACKENDS)}")
    if torch.device(device).type != "cuda":
        raise UserError(f"model.attention_backend={backend} runs on CUDA GPUs only but this run is on "
                        f"{torch.device(device).type}: use model.attention_backend=native")
    try:
        transformer.set_attention_backend(backend)
    except (RuntimeError, ValueError) as err:
        need = f"install {ATTENTION_BACKENDS[backend]}" if ATTENTION_BACKENDS[backend] else "update torch"
        raise UserError(f"model.attention_backend={backend} is not usable here ({str(err).splitlines()[0][:160]}): "
                        f"{need} or use model.attention_backend=native") from err


def compile_blocks(transformer: torch.nn.Module) -> int:
    """``torch.compile`` every repeated block of ``transformer`` in place; returns how many.

    Regional compilation, what diffusers' ``compile_repeated_blocks`` does, over flowalign's list of blocks
    (the FSDP units, :func:`flowalign.parallel.block_modules`; diffusers names no repeated blocks for SD3):
    identical blocks share one compiled graph, so compiling takes seconds where the whole model takes
    minutes, and the code outside the blocks (embeddings, the rollout's step math) stays eager. Blocks are
    compiled before they are sharded, in torchtitan's order."""
    blocks = block_modules(transformer)
    if not blocks:
        raise UserError(f"model.compile: the {type(transformer).__name__} has no repeated blocks to compile; "
                        "use model.compile=false")
    for block in blocks:
        block.compile()
    return len(blocks)


# diffusers keeps a processor's backend in the private attribute ``_attention_backend`` (what
# ``ModelMixin.set_attention_backend`` writes and ``dispatch_attention_fn`` is given), and a processor that runs
# on some backends only lists them in the private ``_SUPPORTED_BACKENDS`` (AnyFlow-FAR's causal attention: flex).
# The two functions below are the only code of ``pipelines`` that reads or writes those names, so a diffusers
# release that renames them breaks here (tests/pipelines/test_memory.py checks them against the installed one).


def processor_backend(processor: Any) -> str | None:
    """The attention backend diffusers' dispatcher runs ``processor`` on (None: the active default)."""
    backend = getattr(processor, "_attention_backend", None)
    return None if backend is None else str(getattr(backend, "value", backend))


def pin_processor_backend(processor: Any, backend: str) -> None:
    """Run ``processor``'s attention on ``backend``, accepted by this instance even where its class lists the
    backends it supports without it (the class and its other instances keep their list)."""
    supported = getattr(processor, "_SUPPORTED_BACKENDS", None)
    if supported is not None and backend not in supported:
        processor._SUPPORTED_BACKENDS = (*supported, backend)
    processor._attention_backend = backend


def offload_text_encoders(policy: Any) -> list[str]:
    """Keep the pipeline's text encoders in CPU memory, on the policy's device only while they encode.

    The policies cache each prompt's embeddings, so the encoders run once per new prompt; between
    those runs their weights (T5-XXL: 9.5 GB in bf16) no longer take device memory. accelerate's
    ``cpu_offload`` leaves meta tensors in the module and moves each layer's weights in for its forward.
    Returns the names of the offloaded components.
    """
    from accelerate import cpu_offload

    names = []
    for name, module in policy.pipe.components.items():
        if name.startswith("text_encoder") and isinstance(module, torch.nn.Module):
            cpu_offload(module, execution_device=policy.device)
            names.append(name)
    return names


_offload = offload_text_encoders  # the option of the same name shadows it below


def apply_memory_options(policy: Any, attention_backend: str = "native", offload_text_encoders: bool = False,
                         compile: bool = False) -> None:
    """The memory and speed options of :func:`pipelines.load` on a built policy of any family: the attention
    backend of its trainable transformer, its text encoders kept in CPU memory, its blocks compiled."""
    set_attention_backend(policy.trainable, attention_backend, policy.device)
    if compile:
        compile_blocks(policy.trainable)
    if offload_text_encoders:
        _offload(policy)
