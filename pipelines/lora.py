"""peft helpers shared by the SD3, FLUX and Wan policies.

Everything here works on a diffusers transformer (a ``PeftAdapterMixin`` model) and the pipeline
class whose ``save_lora_weights`` / ``lora_state_dict`` define the on-disk LoRA format, so an adapter
trained here loads with ``pipe.load_lora_weights(dir)`` like any community LoRA.

One adapter per policy, always named ``"default"`` (peft's and diffusers' default name).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from diffusers.training_utils import cast_training_params
from peft import LoraConfig
from peft.tuners.tuners_utils import BaseTunerLayer
from peft.utils import get_peft_model_state_dict, set_peft_model_state_dict
from torch.distributed.tensor import DTensor

from flowalign.errors import UserError
from flowalign.io import atomic_path
from flowalign.lora_blocks import block_targets

ADAPTER_NAME = "default"
#: diffusers' file name for LoRA weights (``save_lora_weights`` / ``load_lora_weights`` default)
LORA_WEIGHT_NAME = "pytorch_lora_weights.safetensors"
#: keys accepted in ``lora={...}``
LORA_KEYS = {"rank", "alpha", "target_modules", "dropout", "init", "blocks", "compute_dtype"}
#: how an adapter computes under a bf16/fp16 model (``lora={"compute_dtype": ...}``): ``fp32``, peft's own way (each
#: adapted layer casts its input to the adapter's float32 and adds a float32 product to its output), or
#: ``model``, in the model's dtype over the adapter's float32 weights (:func:`compute_in_input_dtype`)
LORA_COMPUTE = ("fp32", "model")


def freeze(module: torch.nn.Module) -> None:
    """No gradients, eval mode: the frozen parts of a pipeline (and the base weights under LoRA)."""
    module.requires_grad_(False)
    module.eval()


def check_options(lora: dict[str, Any] | None, full_finetune: bool) -> None:
    """Reject contradictory or misspelled training options (cheap; called before loading weights)."""
    if lora is not None and full_finetune:
        raise UserError("lora and full_finetune were both given: pick one (lora=None for full fine-tuning)")
    if lora is not None:
        unknown = set(lora) - LORA_KEYS
        if unknown:
            raise UserError(f"lora has unknown key(s) {sorted(unknown)}: allowed keys are {sorted(LORA_KEYS)}")
        if int(lora.get("rank", 8)) < 1:
            raise UserError(f"lora.rank must be a positive integer, got {lora.get('rank')!r}")
        if lora.get("compute_dtype", "fp32") not in LORA_COMPUTE:
            raise UserError(f"lora.compute_dtype {lora.get('compute_dtype')!r}: choose one of {', '.join(LORA_COMPUTE)}")


def setup_training(
    transformer: torch.nn.Module,
    *,
    lora: dict[str, Any] | None,
    full_finetune: bool,
    default_targets: list[str],
    gradient_checkpointing: bool = False,
) -> None:
    """Make ``transformer`` trainable as asked.

    - ``lora={"rank": r, "alpha": a, "target_modules": [...], "dropout": p, "init": "gaussian"}``:
      a peft LoRA adapter on ``target_modules`` (default: the family's attention projections); only
      its tensors require grad. The LoRA B matrices start at zero in peft (both for ``init=True`` and
      ``"gaussian"``), so a fresh adapter leaves the model's output unchanged: policy == reference at
      step 0. Adapter tensors are kept in float32 even when the model runs in bf16/fp16 (the usual
      diffusers recipe, ``cast_training_params``): half-precision optimiser updates on small LoRA
      weights round to nothing.
    - ``full_finetune=True``: every transformer weight requires grad (in the model's dtype).
    - neither: everything stays frozen (sampling / evaluation / reference).

    The options are validated by :func:`check_options`, which the policies call before loading weights.
    """
    freeze(transformer)
    if gradient_checkpointing:
        # diffusers only checkpoints when grad is enabled, so inference passes are unaffected
        transformer.enable_gradient_checkpointing()
    if full_finetune:
        transformer.requires_grad_(True)
        return
    if lora is None:
        return
    rank = int(lora.get("rank", 8))
    config = LoraConfig(
        r=rank,
        lora_alpha=float(lora.get("alpha", rank)),
        lora_dropout=float(lora.get("dropout", 0.0)),
        init_lora_weights=lora.get("init", "gaussian"),
        target_modules=block_targets(transformer, list(lora.get("target_modules") or default_targets),
                                     lora.get("blocks")),
    )
    try:
        transformer.add_adapter(config, adapter_name=ADAPTER_NAME)
    except ValueError as err:
        # peft raises ValueError when no module matches target_modules
        raise UserError(f"lora.target_modules {config.target_modules} do not fit this model: {str(err).splitlines()[0]}") from err
    if next(transformer.parameters()).dtype != torch.float32:
        cast_training_params(transformer, dtype=torch.float32)
        if lora.get("compute_dtype", "fp32") == "model":
            compute_in_input_dtype(transformer)


class InputDtypeLinear(torch.nn.Linear):
    """A LoRA factor (peft's ``lora_A`` / ``lora_B``) whose weights stay float32, the optimiser's master copy,
    while it computes in its input's dtype: the weights are cast in the forward (differentiably, so their
    gradient arrives in float32), as autocast casts a layer's weights. Its state dict is nn.Linear's."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.weight.to(x.dtype), bias)


def compute_in_input_dtype(transformer: torch.nn.Module, on: bool = True) -> int:
    """Run every linear LoRA adapter of ``transformer`` in the dtype of the layer's input (the model's bf16 or
    fp16) over its float32 weights (``on=False``: back to peft's way); returns how many layers changed.

    peft casts each adapted layer's input ``(rows, in)`` to the adapter's float32 and adds a float32 product
    to the layer's output before casting it back: under a bf16 model that is an input-sized float32 copy
    (kept for the backward) and output-sized float32 sums in every adapted projection, memory traffic
    comparable to the projection itself. Here peft's input cast is off (its documented
    ``cast_input_dtype_enabled`` switch) and the factors cast their weights instead, so the branch
    ``B(A(x))·s`` stays in the model's dtype, as it does under the reference implementation's autocast. A
    layer whose factors are not linear (a convolution) keeps peft's way."""
    layers, _ = tuner_layers(transformer)
    changed = 0
    for layer in layers:
        factors = [*layer.lora_A.values(), *layer.lora_B.values()]
        if not factors or not all(type(m) in (torch.nn.Linear, InputDtypeLinear) for m in factors):
            continue
        for m in factors:
            m.__class__ = InputDtypeLinear if on else torch.nn.Linear
        layer.cast_input_dtype_enabled = not on
        changed += 1
    return changed


def has_adapter(transformer: torch.nn.Module) -> bool:
    """True when ``transformer`` carries a peft adapter (added for training or loaded)."""
    return bool(getattr(transformer, "_hf_peft_config_loaded", False)) and ADAPTER_NAME in getattr(
        transformer, "peft_config", {}
    )


def tuner_layers(transformer: torch.nn.Module) -> tuple[list[BaseTunerLayer], list[torch.nn.Parameter]]:
    """The peft LoRA layers inside ``transformer`` and their tensors, found by one walk and remembered
    on the module (keyed by the adapter's config object, so an adapter added later is found again)."""
    key = transformer.peft_config.get(ADAPTER_NAME) if has_adapter(transformer) else None
    cached = transformer.__dict__.get("_flowalign_tuner_layers")
    if cached is None or cached[0] is not key:
        layers = [m for m in transformer.modules() if isinstance(m, BaseTunerLayer)]
        cached = (key, layers, [p for layer in layers for p in layer.parameters()])
        transformer.__dict__["_flowalign_tuner_layers"] = cached
    return cached[1], cached[2]


@contextmanager
def adapter_disabled(transformer: torch.nn.Module) -> Iterator[None]:
    """Run the base model: adapters off inside, back as they were after (even on error).

    Flips only the LoRA layers' own switch (the layers remembered by :func:`tuner_layers`): diffusers'
    ``disable_adapters()`` / ``enable_adapters()`` walk every module and look up the installed peft
    version on each call, and peft's per-layer ``enable_adapters`` also rewrites every adapter tensor's
    ``requires_grad`` (enabling makes them trainable). A LoRA layer's forward reads only its
    ``_disable_adapters`` flag, so that flag alone is set and restored: the tensors' flags are never
    touched (an adapter loaded frozen stays frozen) and a layer switched off before stays off. KL reference
    passes toggle once per trained step, so this is per-step overhead.
    """
    if not has_adapter(transformer):
        raise UserError(
            "reference passes need an adapter to switch off: train with lora={...}, or keep a separate "
            "reference copy of the model when fine-tuning full weights"
        )
    layers, _ = tuner_layers(transformer)
    before = [layer._disable_adapters for layer in layers]
    for layer in layers:
        layer._disable_adapters = True
    try:
        yield
    finally:
        for layer, off in zip(layers, before):
            layer._disable_adapters = off


def frozen_copy(objects: Any, tensors_of: torch.nn.Module, device: torch.device | str) -> Any:
    """A deep copy of ``objects`` (modules, or containers of them) whose parameters and buffers, those of
    ``tensors_of``, are frozen copies on ``device``, copied tensor by tensor: a copy to the CPU never needs
    room for a whole second model on the accelerator. Modules shared within ``objects`` stay shared."""
    memo: dict[int, Any] = {}
    for t in tensors_of.parameters():
        memo[id(t)] = torch.nn.Parameter(t.detach().to(device, copy=True), requires_grad=False)
    for t in tensors_of.buffers():
        memo[id(t)] = t.detach().to(device, copy=True)
    return copy.deepcopy(objects, memo)


@contextmanager
def swapped_attributes(obj: Any, values: dict[str, Any]) -> Iterator[None]:
    """Inside, ``obj``'s attributes named in ``values`` are those values; restored after, even on error."""
    saved = {name: getattr(obj, name) for name in values}
    for name, value in values.items():
        setattr(obj, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(obj, name, value)


def save_adapter(pipeline_class: type, transformer: torch.nn.Module, directory: str | Path) -> Path:
    """Write the adapter as ``<directory>/pytorch_lora_weights.safetensors`` in diffusers' format.

    The LoraConfig (rank, alpha, targets) goes into the safetensors metadata the way diffusers'
    training scripts write it, so ``load_lora_weights`` rebuilds the same scaling ``alpha/rank``.
    A transformer sharded over ranks (FSDP2) is gathered first: then every rank calls this.
    """
    if not has_adapter(transformer):
        raise UserError(
            "save_adapter needs a LoRA adapter: this policy has none (load it with lora={...}; "
            "full fine-tunes save the transformer with save_pretrained instead)"
        )
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    layers = get_peft_model_state_dict(transformer, adapter_name=ADAPTER_NAME)
    # a transformer sharded with FSDP2 holds DTensor shards: gather full tensors (every rank must call)
    layers = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in layers.items()}
    pipeline_class.save_lora_weights(
        directory,
        transformer_lora_layers=layers,
        transformer_lora_adapter_metadata=transformer.peft_config[ADAPTER_NAME].to_dict(),
        weight_name=LORA_WEIGHT_NAME,
    )
    return directory / LORA_WEIGHT_NAME


def find_lora_file(directory: str | Path) -> Path:
    """The LoRA safetensors in ``directory``: a file itself, the folder, or a trainer checkpoint folder.

    Looks for ``pytorch_lora_weights.safetensors`` in the folder, then one level down (a checkpoint
    ``step-000100/`` may keep it in a subfolder such as ``adapter/``).
    """
    path = Path(directory)
    if path.is_file():
        return path
    if not path.is_dir():
        raise UserError(f"adapter path {str(path)!r} does not exist: pass a folder written by save_adapter")
    candidates = [path / LORA_WEIGHT_NAME, *sorted(path.glob(f"*/{LORA_WEIGHT_NAME}"))]
    found = [c for c in candidates if c.is_file()]
    if not found:
        raise UserError(
            f"adapter folder {str(path)!r} holds no {LORA_WEIGHT_NAME} (also looked one level down): "
            "pass the folder written by save_adapter or a trainer checkpoint folder"
        )
    if len(found) > 1:
        raise UserError(
            f"adapter folder {str(path)!r} holds several LoRA files ({', '.join(str(f) for f in found)}): "
            "pass the folder of the one you mean"
        )
    return found[0]


def load_adapter(pipe: Any, transformer: torch.nn.Module, directory: str | Path) -> Path:
    """Load a saved LoRA into ``transformer``; returns the file read.

    - The transformer already has an adapter (a LoRA-trained policy, e.g. resuming): the weights are
      copied into it in place, so parameter objects (and an optimiser holding them) stay valid and
      ``requires_grad`` is unchanged. The file must match the adapter's rank, alpha and targets.
    - No adapter (a frozen policy used for evaluation/sampling): diffusers' own
      ``pipe.load_lora_weights`` adds it, frozen, as any user loading a LoRA would.
    """
    file = find_lora_file(directory)
    if not has_adapter(transformer):
        pipe.load_lora_weights(str(file.parent), weight_name=file.name, adapter_name=ADAPTER_NAME)
        freeze(transformer)  # peft marks loaded adapters trainable; a loaded adapter is for sampling
        return file
    state_dict, metadata = type(pipe).lora_state_dict(
        str(file.parent), weight_name=file.name, return_lora_metadata=True
    )
    prefix = f"{type(pipe).transformer_name}."
    state_dict = {k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)}
    # diffusers keys the saved LoraConfig by component: "transformer.r", "transformer.lora_alpha"
    saved = (metadata.get(f"{prefix}r"), metadata.get(f"{prefix}lora_alpha")) if metadata else None
    copy_into_adapter(transformer, state_dict, saved, file)
    return file


def copy_into_adapter(transformer: torch.nn.Module, state_dict: dict[str, torch.Tensor],
                      saved: tuple[Any, Any] | None, file: Path) -> None:
    """Copy a saved adapter's tensors (keys relative to ``transformer``) into its existing adapter in place,
    refusing another rank/alpha (``saved``, when the file says) or other target modules."""
    config = transformer.peft_config[ADAPTER_NAME]
    if saved is not None and saved != (config.r, config.lora_alpha):
        raise UserError(
            f"adapter {str(file)!r} has rank/alpha {saved} but this policy's LoRA has "
            f"{(config.r, config.lora_alpha)}: load the policy with the lora settings it was trained with"
        )
    expected = set(get_peft_model_state_dict(transformer, adapter_name=ADAPTER_NAME))
    if set(state_dict) != expected:
        missing, extra = sorted(expected - set(state_dict)), sorted(set(state_dict) - expected)
        raise UserError(
            f"adapter {str(file)!r} does not match this policy's LoRA targets (missing {missing[:3]}, "
            f"unexpected {extra[:3]}): load the policy with the lora settings it was trained with"
        )
    flags = [(p, p.requires_grad) for p in transformer.parameters()]
    try:
        with torch.no_grad():
            set_peft_model_state_dict(transformer, state_dict, adapter_name=ADAPTER_NAME)
    except RuntimeError as err:  # shape mismatch: a file without metadata and another rank
        raise UserError(
            f"adapter {str(file)!r} does not fit this policy's LoRA ({str(err).splitlines()[0]}): "
            "load the policy with the lora settings it was trained with"
        ) from err
    for p, flag in flags:
        p.requires_grad_(flag)


# ------------------------------------------------------------------ pipelines without a LoRA loader
#
# Some diffusers pipelines (HunyuanVideo15Pipeline in diffusers 0.42) have no ``load_lora_weights``; their
# transformer's own PeftAdapterMixin is then how diffusers loads a LoRA: ``transformer.load_lora_adapter(dir)``.
# These two functions write and read that format, the one the pipelines' ``save_lora_weights`` writes: keys and
# the LoraConfig (JSON in the safetensors metadata) under ``transformer.``, ``load_lora_adapter``'s default prefix.


def save_model_adapter(transformer: torch.nn.Module, directory: str | Path) -> Path:
    """Write ``<directory>/pytorch_lora_weights.safetensors`` that ``transformer.load_lora_adapter(directory)``
    reads (gathered first under FSDP2: then every rank calls this)."""
    from diffusers.loaders.lora_base import LORA_ADAPTER_METADATA_KEY
    from safetensors.torch import save_file

    if not has_adapter(transformer):
        raise UserError("save_adapter needs a LoRA adapter: this policy has none (load it with lora={...})")
    layers = get_peft_model_state_dict(transformer, adapter_name=ADAPTER_NAME)
    layers = {f"transformer.{k}": (v.full_tensor() if isinstance(v, DTensor) else v).contiguous()
              for k, v in layers.items()}
    # the LoraConfig keyed by component ("transformer.r", ...), as the pipelines' save_lora_weights writes it
    config = {f"transformer.{k}": sorted(v) if isinstance(v, set) else v
              for k, v in transformer.peft_config[ADAPTER_NAME].to_dict().items()}
    file = Path(directory) / LORA_WEIGHT_NAME
    with atomic_path(file) as tmp:
        save_file(layers, str(tmp), metadata={"format": "pt", LORA_ADAPTER_METADATA_KEY: json.dumps(config, sort_keys=True)})
    return file


def load_model_adapter(transformer: torch.nn.Module, directory: str | Path) -> Path:
    """Load a :func:`save_model_adapter` file: in place into an existing adapter, or through diffusers'
    ``transformer.load_lora_adapter`` (then frozen) into a transformer without one."""
    from diffusers.loaders.lora_base import LORA_ADAPTER_METADATA_KEY
    from safetensors import safe_open

    file = find_lora_file(directory)
    if not has_adapter(transformer):
        transformer.load_lora_adapter(str(file.parent), weight_name=file.name, adapter_name=ADAPTER_NAME)
        freeze(transformer)
        return file
    with safe_open(str(file), "pt") as f:
        meta = json.loads((f.metadata() or {}).get(LORA_ADAPTER_METADATA_KEY, "null"))
        state = {k.removeprefix("transformer."): f.get_tensor(k) for k in f.keys()}
    copy_into_adapter(transformer, state, (meta["transformer.r"], meta["transformer.lora_alpha"]) if meta else None, file)
    return file


class AdapterMethods:
    """The adapter methods of the :class:`flowalign.protocols.FlowPolicy` protocol, for a policy with
    ``pipe`` (a diffusers pipeline, whose class defines the LoRA file format), ``transformer`` and
    ``options`` (:class:`pipelines._common.PolicyOptions`)."""

    pipe: Any
    transformer: torch.nn.Module
    options: Any

    @property
    def full_finetune(self) -> bool:
        """Whether every transformer weight trains (then there is no adapter to save, load or disable)."""
        return bool(self.options.full_finetune)

    #: the policy's attributes that hold trained modules (swapped for their frozen copies by the reference)
    trained_modules: tuple[str, ...] = ("transformer",)
    #: frozen copies by attribute name, once :meth:`keep_reference` made them (full fine-tuning)
    reference_modules: dict[str, torch.nn.Module] | None = None

    def keep_reference(self, device: torch.device | str) -> torch.nn.Module:
        """Keep a frozen copy of the trained weights as they are now, on ``device``, which
        :meth:`adapter_disabled` then runs: the reference model of full fine-tuning, which has no adapter
        to switch off. Returns the copy laid out like ``trainable`` (so it can be sharded the same way)."""
        live = {name: getattr(self, name) for name in self.trained_modules}
        copied, self.reference_modules = frozen_copy((self.trainable, live), self.trainable, device)
        freeze(copied)
        return copied

    def adapter_disabled(self) -> AbstractContextManager[None]:
        """Context in which ``velocity`` is the base model's: LoRA switched off, or under full
        fine-tuning the frozen copy of :meth:`keep_reference` in the trained model's place."""
        if self.reference_modules is not None:
            return swapped_attributes(self, self.reference_modules)
        return adapter_disabled(self.transformer)

    def save_adapter(self, directory: str | Path) -> None:
        """Write ``pytorch_lora_weights.safetensors`` that the pipeline's ``load_lora_weights`` reads."""
        save_adapter(type(self.pipe), self.transformer, directory)

    def load_adapter(self, directory: str | Path) -> None:
        """Load a LoRA saved by :meth:`save_adapter` (or a trainer checkpoint folder holding one)."""
        if self.full_finetune:
            raise UserError("load_adapter: this policy fine-tunes full weights; load it with lora={...} or none")
        load_adapter(self.pipe, self.transformer, directory)
