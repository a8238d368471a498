"""``flowalign plan``: memory per rank of a run, estimated on the meta device before any GPU is rented.

Every model of the config's diffusers folder is built from its ``config.json`` on the meta device (no
weights are read, so a folder of configs is enough). Per rank and per strategy the plan adds up:

- weights of the trained models (the transformer; both experts of a two-expert model: the family spec's
  ``trained``), sharded ``1/N`` under fsdp, plus the two blocks being gathered,
- gradients and AdamW's two moments of the trained tensors (sharded under fsdp; on CPU with cpu_offload),
- extra copies of the trained tensors some trainers keep (a frozen reference for a full fine-tune of
  FEST-DPO, or of Flow-GRPO with a KL term unless offloaded, DiffusionNFT/OPSD's behaviour weights, the EMA),
- the frozen text encoders and VAE (whole on every rank),
- activations: a forward of the transformer on meta tensors for the config's batch and resolution,
  counting what autograd saves for backward (attention as memory-efficient kernels keep it: no S×S
  matrix), plus the largest block's share for the backward in flight. With ``parallel.sequence_parallel:
  S`` every rank holds ``1/S`` of the tokens inside the blocks (diffusers splits them before the first
  block and gathers after the last), so what the blocks save is divided by ``S``; what lies outside them
  (embeddings, the gathered output) stays whole. Tensors of text tokens alone that the model's plan does
  not split (Wan's cross-attention keys and values) are whole on every rank too, so the split estimate is
  low by their share: 3 % of Wan's block bytes at 2 latent frames, less for longer videos (tested).
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from flowalign import families
from flowalign.config import TrainConfig
from flowalign.errors import UserError
from flowalign.trainers import trainer_config

GB = 1e9
BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
#: CUDA context, allocator fragmentation and kernels' workspaces: a flat allowance per rank
OVERHEAD_BYTES = 2.0 * GB
#: trainers that keep one more copy of the trained tensors: always, or only under full fine-tuning (a
#: LoRA's reference is the adapter switched off, no copy)
EXTRA_COPIES = {"festdpo": "full", "diffusion_nft": "always", "diffusion_opsd": "always"}


@dataclass
class Model:
    """Parameter counts of a pipeline folder's models, and what the trained transformer needs."""

    family: str
    params: dict[str, int]  # component → parameters
    trained: dict[str, int]  # trained component → its trained parameters (the LoRA's, or all of them)
    largest_block: int  # parameters of the largest block of the trained models
    activations: "Activations"  # bytes saved for backward, per sample of the trainer's batch

    @property
    def trainable(self) -> int:
        """Trained parameters over every trained component."""
        return sum(self.trained.values())

    @property
    def trained_weights(self) -> int:
        """Parameters of the trained components (their base weights, under a LoRA too)."""
        return sum(self.params[c] for c in self.trained)


@dataclass
class Activations:
    """Bytes one forward saves for backward (per sample), split by where the tokens are whole."""

    outside: float  # outside the blocks (embeddings, output head): whole on every rank
    in_blocks: float  # inside all blocks: split over sequence ranks
    largest_block: float  # the largest block's share (again, for its gradients in flight)
    block_inputs: float  # every block's inputs: what gradient checkpointing keeps

    def per_rank(self, checkpointed: bool, sequence_parallel: int = 1) -> float:
        """Saved bytes per rank: every block's inputs and one block recomputed under gradient
        checkpointing, else all of it; the blocks' part divided over ``sequence_parallel`` ranks."""
        s = sequence_parallel
        if checkpointed:
            return self.outside + (self.block_inputs + 2 * self.largest_block) / s
        return self.outside + (self.in_blocks + self.largest_block) / s


@dataclass
class Settings:
    """What the memory depends on (one strategy, one GPU count)."""

    strategy: str
    gpus: int
    cpu_offload: bool
    finetune: str
    dtype: str
    gradient_checkpointing: bool
    batch_size: int
    extra_copies: int
    offload_text_encoders: bool = False
    sequence_parallel: int = 1
    changes: list[str] = field(default_factory=list)


def _library_module(library: str) -> Any:
    """The module a ``model_index.json`` entry names: a package (``diffusers``, ``transformers``) or, as diffusers
    resolves it, a pipeline's own module (``["<pipeline module>", "<class>"]`` → ``diffusers.pipelines.<module>``)."""
    try:
        return importlib.import_module(library)
    except ModuleNotFoundError:
        return importlib.import_module(f"diffusers.pipelines.{library}")


def build_on_meta(folder: Path) -> dict[str, nn.Module]:
    """Every ``torch.nn.Module`` of a diffusers folder (``model_index.json``) built on the meta device."""
    index = json.loads((folder / "model_index.json").read_text())
    models = {}
    for name, entry in index.items():
        if name.startswith("_") or not isinstance(entry, list) or None in entry or not (folder / name).is_dir():
            continue
        library, class_name = entry
        cls = getattr(_library_module(library), class_name, None)
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            continue  # schedulers, tokenizers
        with torch.device("meta"):
            if library != "transformers":  # diffusers' own classes and its pipelines' modules (ConfigMixin)
                models[name] = cls.from_config(cls.load_config(str(folder / name)))
            else:
                models[name] = cls(cls.config_class.from_pretrained(str(folder / name)))
    if "transformer" not in models:
        raise UserError(f"model.path {folder} has no transformer/config.json: pass a diffusers pipeline folder")
    return models


def lora_parameters(module: nn.Module, targets: list[str], rank: int) -> int:
    """Parameters a LoRA of ``rank`` adds on the linear layers named by ``targets`` (peft's suffix match)."""
    total = 0
    for name, m in module.named_modules():
        if isinstance(m, nn.Linear) and any(name == t or name.endswith("." + t) for t in targets):
            total += rank * (m.in_features + m.out_features)
    return total


class _FlashAttention(torch.autograd.Function):
    """Stands in for SDPA on meta tensors, saving what memory-efficient kernels save (q, k, v, out, lse)."""

    @staticmethod
    def forward(ctx, q, k, v):
        out = q.new_empty(*q.shape[:-1], v.shape[-1])
        ctx.save_for_backward(q, k, v, out, q.new_empty(q.shape[:-1], dtype=torch.float32))
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, _, _ = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


class _AttentionAsFlash(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.scaled_dot_product_attention:
            q, k, v = (list(args) + [kwargs.get(n) for n in ("query", "key", "value")[len(args):]])[:3]
            return _FlashAttention.apply(q, k, v)
        return func(*args, **kwargs)


def saved_activation_bytes(transformer: nn.Module, blocks: list[nn.Module], inputs: dict[str, Any]) -> Activations:
    """What one forward saves for backward (each storage once, weights excluded), inside and outside the
    blocks, the largest block's share and every block's inputs."""
    weights = {p.untyped_storage()._cdata for p in transformer.parameters()}
    saved: dict[int, int] = {}
    per_block: dict[int, int] = {}
    block_inputs = [0]
    current = [None]

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        key = storage._cdata
        if key not in weights and key not in saved:
            saved[key] = storage.nbytes()
            if current[0] is not None:
                per_block[current[0]] = per_block.get(current[0], 0) + storage.nbytes()
        return t

    def enter(i):
        def hook(module, args, kwargs):
            current[0] = i
            block_inputs[0] += sum(a.nbytes for a in [*args, *kwargs.values()] if isinstance(a, torch.Tensor))
        return hook

    handles = [b.register_forward_pre_hook(enter(i), with_kwargs=True) for i, b in enumerate(blocks)]
    try:
        transformer.requires_grad_(True)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), _AttentionAsFlash():
            transformer(**inputs)
    finally:
        for h in handles:
            h.remove()
    in_blocks = sum(per_block.values())
    return Activations(sum(saved.values()) - in_blocks, in_blocks, max(per_block.values(), default=0), block_inputs[0])


def inspect_model(cfg: TrainConfig, folder: Path) -> Model:
    """Parameter counts and activation bytes of the config's model, built on the meta device; the family's
    spec (:mod:`flowalign.families`) gives its default size, guidance, LoRA targets and transformer inputs."""
    import pipelines

    from flowalign.parallel import block_modules

    spec = families.detect(folder) if cfg.model.family is None else families.get(cfg.model.family, "model.family")
    models = build_on_meta(folder)
    names = [c for c in spec.trained if c in models]
    from diffusers.utils import logging as diffusers_logging

    level = diffusers_logging.get_verbosity()
    diffusers_logging.set_verbosity_error()  # its warning about casting a loaded model does not apply to meta tensors
    try:
        for name in names:
            models[name] = models[name].to(pipelines.parse_dtype(cfg.model.dtype))
    finally:
        diffusers_logging.set_verbosity(level)
    transformer = models["transformer"]  # one step's forward runs one of the trained models
    blocks = block_modules(transformer)
    params = {name: sum(p.numel() for p in m.parameters()) for name, m in models.items()}
    if cfg.model.finetune == "lora":
        targets = cfg.model.lora.target_modules or list(spec.lora_targets)
        trained = {c: lora_parameters(models[c], targets, cfg.model.lora.rank) for c in names}
    else:
        trained = {c: params[c] for c in names}
    largest = max((sum(p.numel() for p in b.parameters()) for c in names for b in block_modules(models[c])), default=0)
    size = {**spec.size, **_folder_defaults(folder), **{k: v for k, v in (cfg.model.defaults or {}).items() if v is not None}}
    tcfg = cfg.trainer
    guidance = tcfg.get("guidance_scale") or size.get("guidance_scale") or spec.guidance
    twice = spec.guidance_kind(transformer.config, families.read_index(folder)) in ("cfg", "true_cfg") and float(guidance) > 1
    batch = int(tcfg.get("batch_size", 8)) * (2 if twice else 1)
    inputs = spec.transformer_inputs(transformer.config, batch, size, dtype=next(transformer.parameters()).dtype)
    try:
        act = saved_activation_bytes(transformer, blocks, inputs)
    except (RuntimeError, NotImplementedError, ValueError) as err:
        # a value-dependent op (.item(), boolean token gathers) or a kernel with no meta implementation
        # (flex attention's block-causal masks)
        raise UserError(f"flowalign plan cannot size the {spec.name} transformer on the meta device: its forward "
                        f"depends on tensor values or on kernels the meta device lacks "
                        f"({str(err).splitlines()[0][:100]}). Size the run on a GPU with a real forward "
                        "instead") from None
    per_sample = int(tcfg.get("batch_size", 8))  # the trainer's batch (a CFG pass doubles it inside)
    per = lambda v: v / per_sample
    return Model(spec.name, params, trained, largest, Activations(per(act.outside), per(act.in_blocks),
                                                                  per(act.largest_block), per(act.block_inputs)))


def _folder_defaults(folder: Path) -> dict[str, Any]:
    path = folder / "flowalign.json"
    data = json.loads(path.read_text()) if path.is_file() else {}
    return {k: v for k, v in data.items() if k in ("height", "width", "num_frames", "max_sequence_length", "guidance_scale") and v}


def memory_rows(model: Model, s: Settings) -> dict[str, float]:
    """Bytes per rank by kind for one strategy (see the module docstring)."""
    n = s.gpus if s.strategy == "fsdp" else 1
    w = BYTES[s.dtype]
    train_bytes = 4 if s.finetune == "lora" else w  # LoRA tensors are kept in fp32
    base = model.trained_weights * w
    gathered = 2 * model.largest_block * w if s.strategy == "fsdp" else 0
    on_gpu = 0 if (s.cpu_offload and s.strategy == "fsdp") else 1
    lora = model.trainable * 4 if s.finetune == "lora" else 0
    return {
        "weights (trained model)": (base + lora) / n * on_gpu + gathered,
        "gradients": model.trainable * train_bytes / n,
        "optimiser state (AdamW)": 2 * model.trainable * train_bytes / n * on_gpu,
        "reference / EMA copies": s.extra_copies * model.trainable * train_bytes / n,
        "frozen text encoders + VAE": sum(v for k, v in model.params.items() if k not in model.trained
                                          and not (s.offload_text_encoders and k.startswith("text_encoder"))) * w,
        "activations": s.batch_size * model.activations.per_rank(s.gradient_checkpointing, s.sequence_parallel),
        "overhead (CUDA context, allocator)": OVERHEAD_BYTES,
    }


def smallest_fix(model: Model, s: Settings, limit: float) -> str | None:
    """The first single change (least disruptive first) after which the run fits, or None."""
    candidates: list[tuple[str, Settings]] = []
    if not s.gradient_checkpointing:
        candidates.append(("model.gradient_checkpointing=true", replace(s, gradient_checkpointing=True)))
    if not s.offload_text_encoders:
        candidates.append(("model.offload_text_encoders=true", replace(s, offload_text_encoders=True)))
    if s.strategy == "ddp" and s.gpus > 1:
        candidates.append(("parallel.strategy=fsdp", replace(s, strategy="fsdp")))
    if s.strategy == "fsdp" and not s.cpu_offload:
        candidates.append(("parallel.cpu_offload=true", replace(s, cpu_offload=True)))
    b = s.batch_size // 2
    while b >= 1:
        candidates.append((f"trainer.batch_size={b}", replace(s, batch_size=b)))
        b //= 2
    degree = 2 * s.sequence_parallel
    while s.gpus % degree == 0:  # each sample's tokens over more of the GPUs
        candidates.append((f"parallel.sequence_parallel={degree}", replace(s, sequence_parallel=degree)))
        degree *= 2
    candidates.append((f"--gpus {s.gpus * 2} with parallel.strategy=fsdp", replace(s, strategy="fsdp", gpus=s.gpus * 2)))
    for text, changed in candidates:
        if sum(memory_rows(model, changed).values()) <= limit:
            return text
    return None


def settings(cfg: TrainConfig, strategy: str, gpus: int) -> Settings:
    name = str(cfg.trainer.get("name", "flow_grpo"))
    extra = {"always": 1, "full": int(cfg.model.finetune == "full")}.get(EXTRA_COPIES.get(name, ""), 0)
    extra += int(float(cfg.trainer.get("ema_decay", 0) or 0) > 0)
    extra += reference_copy(cfg, name)
    return Settings(strategy, gpus, cfg.parallel.cpu_offload, cfg.model.finetune, cfg.model.dtype,
                    cfg.model.gradient_checkpointing, int(cfg.trainer.get("batch_size", 8)), extra,
                    cfg.model.offload_text_encoders, cfg.parallel.sequence_parallel)


def reference_copy(cfg: TrainConfig, name: str) -> int:
    """1 when the trainer keeps a frozen reference copy of a full fine-tune on the GPU (e.g. Flow-GRPO's
    KL term; ``trainer.reference_offload`` keeps it in CPU memory), else 0."""
    trainer, tcfg = trainer_config(cfg.trainer)
    return int(trainer.needs_reference(cfg, tcfg) and not tcfg.reference_offload)


def human(n: float, unit: str = "") -> str:
    """``11.90B`` / ``83.65M`` for counts, ``23.8 GB`` for bytes."""
    if unit == "GB":
        return f"{n / GB:.1f} GB"
    for div, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.2f}{suffix}"
    return str(int(n))


def plan_text(cfg: TrainConfig, folder: Path, gpus: int, gpu_memory_gb: float) -> str:
    """The report ``flowalign plan`` prints: components, then memory per rank for ddp and fsdp, verdicts."""
    model = inspect_model(cfg, folder)
    sp = cfg.parallel.sequence_parallel
    if gpus % sp:
        raise UserError(f"parallel.sequence_parallel={sp} must divide --gpus {gpus}")
    lines = [f"model {folder} ({model.family}), finetune {cfg.model.finetune}, dtype {cfg.model.dtype}, "
             f"trainer {cfg.trainer.get('name', 'flow_grpo')}, batch {int(cfg.trainer.get('batch_size', 8))} per rank"
             + (f", tokens split over {sp} sequence ranks" if sp > 1 else "")]
    for name, count in model.params.items():
        role = f"trained: {human(model.trained[name])}" if name in model.trained else "frozen"
        lines.append(f"  {name:<16} {human(count):>8}  ({role})")
    strategies = ["ddp", "fsdp"] if gpus > 1 else ["ddp"]
    rows = {s: memory_rows(model, settings(cfg, s, gpus)) for s in strategies}
    limit = gpu_memory_gb * GB
    lines.append(f"memory per rank on {gpus} GPU(s) of {gpu_memory_gb:g} GB"
                 + ("" if gpus > 1 else " (fsdp needs 2 or more)"))
    lines.append(f"  {'':<36}" + "".join(f"{s:>12}" for s in strategies))
    for kind in rows[strategies[0]]:
        lines.append(f"  {kind:<36}" + "".join(f"{human(rows[s][kind], 'GB'):>12}" for s in strategies))
    totals = {s: sum(r.values()) for s, r in rows.items()}
    lines.append(f"  {'total':<36}" + "".join(f"{human(totals[s], 'GB'):>12}" for s in strategies))
    for s in strategies:
        if totals[s] <= limit:
            lines.append(f"{s}: fits ({human(limit - totals[s], 'GB')} to spare)")
        else:
            fix = smallest_fix(model, settings(cfg, s, gpus), limit)
            lines.append(f"{s}: does not fit; " + (f"smallest change that fits: {fix}" if fix else
                                                    "no single change fits (use more or larger GPUs, or LoRA)"))
    return "\n".join(lines)
