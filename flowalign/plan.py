"""``flowalign plan``: memory per rank of a run, estimated on the meta device before any GPU is rented.

Every model of the config's diffusers folder is built from its ``config.json`` on the meta device (no
weights are read, so a folder of configs is enough). Per rank and per strategy the plan adds up:

- weights of the trained models (the transformer; both experts of a two-expert model: the family spec's
  ``trained``), sharded ``1/N`` under fsdp, plus the two blocks being gathered,
- gradients and AdamW's two moments of the trained tensors (sharded under fsdp; on CPU with cpu_offload),
- the copies of weights the trainer declares (``weight_copies``: a frozen reference for a full fine-tune
  with a reference term unless offloaded, behaviour weights, snapshots, teachers, critics), and the EMA,
- the frozen text encoders and VAE (whole on every rank),
- the frozen reward models (whole on every rank, never sharded; :mod:`flowalign.plan_rewards`): each reward of
  ``rewards`` and ``eval.rewards`` and the evaluation benchmark's own, built by every rank and moved to its
  GPU unless its ``device`` option says otherwise, and a trainer's frozen encoders (GARDO's diversity
  encoder: ``frozen_encoders``). Each states its size itself from its folder's configs on the meta device,
  in the dtype it runs in (``planned_bytes``: :class:`flowalign.protocols.SizedReward`), a folder not there
  yet on the released model's config (``assets/reward_architectures/``); a remote judge or a reward on the
  CPU holds nothing there. One that cannot say (a plug-in without ``planned_bytes``, a folder that does not
  exist and no architecture to stand in) is printed as ``not counted: NAME (why)``, not counted as 0.
- activations of one training forward and backward, as the trainer runs it: a forward of the transformer on
  meta tensors for one chunk of ``trainer.batch_size`` samples at the config's resolution, counting what
  autograd saves for backward (attention as memory-efficient kernels keep it: no S×S matrix), plus the
  largest block's share for the backward in flight. Only the rows that carry gradients count: under CFG
  with ``cfg_grad: detached`` (Flow-GRPO's default) the trainer backpropagates through the conditional
  half alone (B rows, the unconditional velocity stored by the rollout or computed without grad), with
  ``cfg_grad: full``, ``first_pass: batched`` or a trainer that calls the guided velocity itself, through
  both (2B rows). Only the trained tensors require grad: under LoRA the frozen base weights save no input
  for a weight gradient (a frozen linear's input is kept only where a LoRA adapter reads it). With ``parallel.sequence_parallel:
  S`` every rank holds ``1/S`` of the tokens inside the blocks (diffusers splits them before the first
  block and gathers after the last), so what the blocks save is divided by ``S``; what lies outside them
  (embeddings, the gathered output) stays whole. Tensors of text tokens alone that the model's plan does
  not split (Wan's cross-attention keys and values) are whole on every rank too, so the split estimate is
  low by their share: 3 % of Wan's block bytes at 2 latent frames, less for longer videos (tested).
- sampling's peak where it is above the update's: the VAE decoding one chunk of a step's rollouts
  (``model.decode_batch_size``, else the family's), run without grad on meta tensors and counting the
  bytes alive at once; only what exceeds the update's activations and gradients is added (the two
  phases do not overlap). Wan's causal video decoder in float32 keeps two frames of every convolution's
  input: 15.6 GB for 2 videos at 480×832×9, more than its checkpointed training pass. Families whose
  transformer reads packed or conditioned latents are not sized here (0). A trainer that runs passes
  with a copy of the trained tensors swapped into the live parameters (a snapshot, behaviour weights,
  a teacher adapter: :func:`flowalign.trainers.copies.swaps_in`; EMA weights at evaluation) holds the
  live values on the device meanwhile, one more copy of the trained tensors (per rank, sharded under
  fsdp, whether the swapped copy itself lives on the device or in CPU memory). Those passes run outside
  the update, while the gradients are freed, so the live copy takes the gradients' place: it adds to
  the sampling peak (rollouts and their decoding may run under it), and to nothing else.
- a differentiable reward's gradient through the VAE decoder, where the trainer takes one while it holds the
  step (DiffusionOPSD's reward-gradient targets: ``step_holdings``' ``reward_gradient`` moment): the decoder's
  forward with grad and its backward for one training chunk, on meta tensors, counting the bytes alive at
  once (checkpointing the decode changes nothing here: its backward recomputes the forward with grad). At
  512 px the SD3 VAE keeps 3.1 GB an image, eight times its no-grad decode. The reward models' own
  activations on the decoded images are not counted (their size depends on each reward's input).
- rollouts: a step's ``prompts_per_step × group_size`` samples on this rank stay on the GPU until its
  update is done, each with its trajectory of ``num_steps + 1`` float32 latents, its log-probabilities
  (``num_steps`` floats, kept in CPU memory by the sampler: counted anyway, they are small), the velocities
  of every step where the trainer stores them (DiffusionOPSD-style self-distillation, RG-OPD, GRPO-Guard's
  ratio normalisation; CFG's unconditional branch under ``cfg_grad: detached``), its text conditioning
  (both branches under CFG) and its decoded image or video in float32. The latent is sized as the
  transformer's input: for a model that also reads an input image's tokens (Kontext, Qwen-Image-Edit) or
  condition channels (image-to-video) that errs high. What a step holds is the trainer's own statement,
  phase by phase (:meth:`flowalign.trainers.base.GroupTrainer.step_holdings`, in the vocabulary of
  :mod:`flowalign.plan_holdings`): Self-OPD's decoded branch candidates and KVPO's anchor streams while it
  scores (counted with sampling's peak), Diffusion-DPO's pairs (not its rollouts) through the update, KVPO
  nothing then (its branches are in CPU memory), a Flow-GRPO-family trainer with a KL its reference step
  means (one float32 latent per trained step a sample; none under fsdp, where the loss computes them), Flow-OPD
  its teachers' step means beside them, or under velocity_distillation its states and targets, not rollouts.
- strategies: a trainer that refuses fsdp (its ``check_config``, as GARDO's) is planned under ddp alone, and
  fsdp is never suggested to it as a fix.

A recipe whose ``model.path`` does not exist (the shipped recipes name a placeholder such as
``/path/to/FLUX.1-dev``) is planned on its published architecture: ``configs/<name>/...`` on
``assets/architectures/<name>``, said in the plan's first line. Every component's ``config.json`` is
checked before it is built (:mod:`flowalign.component_config`): a bad value is one line naming the field.
"""

from __future__ import annotations

import json
import weakref
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Collection

import torch
import torch.utils._python_dispatch
from torch import nn

from flowalign import families
from flowalign.component_config import library_module, read_component_config
from flowalign.config import TrainConfig
from flowalign.errors import UserError
from flowalign.logger import diffusers_warnings_off
from flowalign.model_signature import input_signature, model_signature
from flowalign.paths import REPO_ROOT
from flowalign.plan_holdings import Holding, StepHoldings, loop_holdings
from flowalign.plan_rewards import FrozenModels, frozen_models
from flowalign.trainers import trainer_config
from flowalign.trainers.copies import device_copies, device_own_params, swaps_in

GB = 1e9
BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
#: CUDA context, allocator fragmentation and kernels' workspaces: a flat allowance per rank
OVERHEAD_BYTES = 2.0 * GB
#: what the estimate has been checked against (the measured peaks: docs/performance.md, "Memory planner")
CALIBRATION = ("calibrated on H200 measurements: SD3.5-M Flow-GRPO 512 px without gradient checkpointing, "
               "Wan 2.1-1.3B 480x832x9 with; see docs/performance.md")
#: the published architectures (configs only, no weights), one folder per released model
ARCHITECTURES = REPO_ROOT / "assets" / "architectures"
#: a configs/ folder whose model ships no architecture of its own here, and the one it shares: Z-Image and its
#: distilled Z-Image-Turbo are the same 6B single-stream DiT, text encoder and VAE; LongLive's
#: and Self-Forcing's causal generators are Wan 2.1-T2V-1.3B's transformer, with its UMT5 and VAE, streamed
#: (causal-wan2.1-1.3b: Wan 2.1-1.3B's configs in a folder marked causal)
SAME_ARCHITECTURE = {"z-image": "z-image-turbo", "longlive": "causal-wan2.1-1.3b", "self-forcing": "causal-wan2.1-1.3b"}


@dataclass
class Model:
    """Parameter counts of a pipeline folder's models, and what the trained transformer needs."""

    family: str
    params: dict[str, int]  # component → parameters
    trained: dict[str, int]  # trained component → its trained parameters (the LoRA's, or all of them)
    largest_block: int  # parameters of the largest block of the trained models
    activations: "Activations"  # bytes saved for backward, per sample of the trainer's batch
    rollout: "Rollout" = field(default_factory=lambda: Rollout(0, 0, 0))  # bytes one rollout sample keeps
    cfg_doubles: bool = False  # whether the guidance runs every pass twice (CFG with a scale above 1)
    decode: float = 0.0  # bytes live at the peak of the VAE decoding one chunk of rollouts (0: not sized)
    vae_bytes_per_param: int = 0  # the VAE's weights' element size where it differs from the model dtype
    encode: float = 0.0  # bytes live at the peak of the VAE encoding one image (0: not sized, or none encoded)
    #: bytes live at the peak of one training chunk's decode with grad and its backward (0: not sized, or the
    #: trainer takes no reward gradient)
    reward_gradient: float = 0.0

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
class Rollout:
    """Bytes one rollout sample keeps on the GPU until its step's update is done, besides its latents'
    trajectory (see :meth:`Settings.rollout_bytes`)."""

    latent: float  # one latent, float32: the trajectory holds num_steps + 1, a stored velocity one more each step
    conditioning: float  # the sample's text conditioning (both branches under CFG)
    decoded: float  # its decoded image or video, float32
    kv_cache: float = 0.0  # a streamed sample's KV caches (the policy's kv_cache_bytes), 0 for other models


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
    #: copies of the whole trained models (e.g. a teacher of the student's architecture)
    model_copies: int = 0
    offload_text_encoders: bool = False
    sequence_parallel: int = 1
    changes: list[str] = field(default_factory=list)
    prompts_per_step: int = 0  # a step's prompts on this rank, each rolled out group_size times
    group_size: int = 0
    num_steps: int = 0  # rollout steps T
    #: velocities stored per rollout step, in float32 latents (a bf16 unconditional branch counts 0.5)
    stored_velocities: float = 0.0
    #: parameters of networks of the trainer's own on the device (a critic), trained in float32 with Adam
    own_params: int = 0
    #: whether passes run with other trained tensors swapped into the live parameters, which keeps a copy
    #: of the live ones on the device (:func:`flowalign.weight_swap.swapped_in`)
    swapped_in: bool = False
    #: what a step holds per prompt, phase by phase (None: the loop's rollouts, ``group_size`` a prompt)
    holdings: StepHoldings | None = None
    #: bytes of the frozen reward models (and a trainer's frozen encoders) on each rank's device
    #: (:mod:`flowalign.plan_rewards`)
    frozen_rewards: float = 0.0

    @property
    def samples(self) -> int:
        """Rollout samples a step draws on this rank."""
        return self.prompts_per_step * self.group_size

    def sample_bytes(self, rollout: Rollout) -> float:
        """One rollout sample: ``T + 1`` latents, the stored velocities of ``T`` steps, ``T`` float32
        log-probabilities, the conditioning, the decoded sample and a streamed sample's KV caches."""
        t = self.num_steps
        return ((t + 1 + t * self.stored_velocities) * rollout.latent + 4 * t + rollout.conditioning + rollout.decoded
                + rollout.kv_cache)

    def rollout_bytes(self, rollout: Rollout) -> float:
        """What a step's rollouts hold, all ``samples`` of them (:meth:`sample_bytes` each)."""
        return self.samples * self.sample_bytes(rollout)

    def step_holdings(self) -> StepHoldings:
        """What the step holds per prompt (the loop's rollouts unless the trainer's are stated)."""
        return self.holdings if self.holdings is not None else loop_holdings(self.group_size)

    def holding_bytes(self, holding: Holding, rollout: Rollout) -> float:
        """Bytes of ``holding`` over the step's prompts on this rank (its ``means`` only where the trained tensors
        are whole: under fsdp the loss computes them as it goes)."""
        latents = holding.latents + (holding.means if self.strategy != "fsdp" else 0.0)
        per_prompt = (holding.rollouts * self.sample_bytes(rollout) + latents * rollout.latent
                      + holding.conditionings * rollout.conditioning + holding.decoded * rollout.decoded
                      + holding.kv_caches * rollout.kv_cache)
        return self.prompts_per_step * per_prompt

    def held_bytes(self, rollout: Rollout) -> float:
        """What the step keeps on the device until its update is done."""
        return self.holding_bytes(self.step_holdings().update, rollout)

    def outside_update_bytes(self, rollout: Rollout, decode: float, swapped: float, encode: float = 0.0,
                             reward_gradient: float = 0.0) -> float:
        """The most the step holds at once while it samples and scores: each moment's holdings, plus a chunk's
        ``decode`` peak and the ``swapped`` live copy where a decode runs, the live copy alone where passes run
        under swapped-in weights without one, one image's ``encode`` peak where images are encoded, a training
        chunk's ``reward_gradient`` peak where a reward's gradient is taken through the decoder (0 without
        moments)."""
        def extra(m: Holding) -> float:
            return ((decode + swapped if m.decoding else swapped if m.swapping else 0.0)
                    + (encode if m.encoding else 0.0) + (reward_gradient if m.reward_gradient else 0.0))

        return max((self.holding_bytes(m, rollout) + extra(m) for m in self.step_holdings().moments), default=0.0)


def build_on_meta(folder: Path) -> dict[str, nn.Module]:
    """Every ``torch.nn.Module`` of a diffusers folder (``model_index.json``) built on the meta device, each
    ``config.json`` checked first; a config the class cannot build from is one line naming it."""
    index = families.read_index(folder)
    models = {}
    for name, entry in index.items():
        if (name.startswith("_") or not isinstance(entry, list) or len(entry) != 2 or None in entry
                or not (folder / name).is_dir()):
            continue
        library, class_name = entry
        cls = getattr(library_module(library), class_name, None)
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            continue  # schedulers, tokenizers
        config = read_component_config(folder, name, cls)
        try:
            with torch.device("meta"):
                if library != "transformers":  # diffusers' own classes and its pipelines' modules (ConfigMixin)
                    models[name] = cls.from_config(config)
                else:
                    models[name] = cls(cls.config_class.from_pretrained(str(folder / name)))
        except (TypeError, ValueError, RuntimeError, AssertionError, KeyError, IndexError, ZeroDivisionError) as err:
            # settings that are each a number but do not fit together (e.g. heads that do not divide the width)
            first = (str(err).strip().splitlines() or [type(err).__name__])[0][:160]
            raise UserError(f"model folder {folder}: {name}/config.json does not build a {class_name} ({first}); "
                            "fix the settings it names or restore the file from the original download") from None
    if "transformer" not in models:
        raise UserError(f"model.path {folder} has no transformer/config.json: pass a diffusers pipeline folder")
    return models


def planning_folder(model_path: str, config_path: str | Path | None, path_given: bool) -> tuple[Path, str | None]:
    """The folder to plan on, and the line saying so when it is not ``model.path`` itself.

    A ``model.path`` that does not exist is the recipe's placeholder for a download: a recipe under
    ``configs/<name>/`` is then planned on ``assets/architectures/<name>`` (or the architecture it shares,
    :data:`SAME_ARCHITECTURE`). One given on the command line
    (``path_given``) is taken as meant."""
    from flowalign.train import resolve_model_path

    folder = resolve_model_path(model_path)
    if folder.exists():
        return folder, None
    published = sorted(p.name for p in ARCHITECTURES.iterdir() if (p / "model_index.json").is_file()) \
        if ARCHITECTURES.is_dir() else []
    name = Path(config_path).resolve().parent.name if config_path else None
    name = SAME_ARCHITECTURE.get(name, name)
    if name in published and not path_given:
        arch = ARCHITECTURES / name
        shown = arch.relative_to(REPO_ROOT) if arch.is_relative_to(REPO_ROOT) else arch
        return arch, (f"model.path {model_path} does not exist: planning on the published architecture {shown} "
                      "(its configs, no weights)")
    raise UserError(f"model.path {model_path} does not exist: point it at the model's diffusers folder, or plan a "
                    f"published architecture with model.path=assets/architectures/NAME "
                    f"({', '.join(published) or 'none shipped here'})")


def lora_parameters(module: nn.Module, targets: list[str], rank: int) -> int:
    """Parameters a LoRA of ``rank`` adds on the linear layers named by ``targets`` (peft's match: a module's
    full name, or its suffix after a dot)."""
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
    """SDPA and flex attention (block-causal masks, which have no meta kernel) as :class:`_FlashAttention`:
    a flex kernel saves the same q, k, v, out and log-sum-exp."""

    def __enter__(self):
        import torch.nn.attention.flex_attention as flex

        self._flex = flex, flex.flex_attention
        flex.flex_attention = _flex_as_flash  # looked up at call time by diffusers' flex backend
        return super().__enter__()

    def __exit__(self, *exc):
        flex, original = self._flex
        flex.flex_attention = original
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.scaled_dot_product_attention:
            q, k, v = (list(args) + [kwargs.get(n) for n in ("query", "key", "value")[len(args):]])[:3]
            return _FlashAttention.apply(q, k, v)
        return func(*args, **kwargs)


def _flex_as_flash(query, key, value, *args, return_lse: bool = False, **kwargs):
    out = _FlashAttention.apply(query, key, value)
    return (out, query.new_empty(query.shape[:-1], dtype=torch.float32)) if return_lse else out


def add_lora_on_meta(transformer: nn.Module, targets: list[str], rank: int, alpha: float,
                     compute_dtype: str = "fp32") -> None:
    """The training LoRA on a meta transformer, as the policies add it (:func:`pipelines.lora.setup_training`):
    peft's adapter on ``targets``, its tensors in float32, the base weights frozen. The forward then saves
    what training's does: a frozen layer keeps no input for a weight gradient, and each adapted layer keeps
    the float32 copy of its input that peft casts for the adapter (one per layer, even where ``to_q``,
    ``to_k`` and ``to_v`` read the same input), unless ``compute_dtype`` is ``model``
    (:func:`pipelines.lora.compute_in_input_dtype`)."""
    from peft import LoraConfig

    transformer.requires_grad_(False)
    with torch.device("meta"):  # the adapter's tensors made on meta: not drawn at random on the CPU, then dropped
        transformer.add_adapter(LoraConfig(r=rank, lora_alpha=float(alpha), target_modules=list(targets)))
    for p in transformer.parameters():
        if p.requires_grad:
            p.data = p.data.float()
    if compute_dtype == "model":
        from pipelines import compute_in_input_dtype

        compute_in_input_dtype(transformer)


def saved_activation_bytes(transformer: nn.Module, blocks: list[nn.Module], inputs: dict[str, Any]) -> Activations:
    """What one forward saves for backward (each storage once, weights excluded), inside and outside the
    blocks, the largest block's share and every block's inputs (each storage once: a timestep embedding
    or rotary table every block reads is one tensor). The transformer's parameters that require grad
    are those training updates (all of them unless :func:`add_lora_on_meta` froze the base)."""
    weights = {p.untyped_storage()._cdata for p in transformer.parameters()}
    saved: dict[int, int] = {}
    per_block: dict[int, int] = {}
    block_inputs = [0]
    seen_inputs: set[int] = set()
    # the inputs counted stay referenced until the forward ends: a freed storage's address may be reused by a
    # later block's input, which would then be taken for one already counted (different in every process)
    counted: list[torch.Tensor] = []
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
            for a in [*args, *kwargs.values()]:
                if isinstance(a, torch.Tensor) and a.untyped_storage()._cdata not in seen_inputs:
                    seen_inputs.add(a.untyped_storage()._cdata)
                    counted.append(a)
                    block_inputs[0] += a.untyped_storage().nbytes()
        return hook

    handles = [b.register_forward_pre_hook(enter(i), with_kwargs=True) for i, b in enumerate(blocks)]
    try:
        if not any(p.requires_grad for p in transformer.parameters()):
            transformer.requires_grad_(True)  # a full fine-tune
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), _AttentionAsFlash():
            transformer(**inputs)
    finally:
        for h in handles:
            h.remove()
    in_blocks = sum(per_block.values())
    return Activations(sum(saved.values()) - in_blocks, in_blocks, max(per_block.values(), default=0), block_inputs[0])


class _LiveBytes(torch.utils._python_dispatch.TorchDispatchMode):
    """The most bytes of tensors made inside it that were alive at once (each storage once, freed when its
    last tensor goes): a no-grad pass's peak on the meta device, inputs and weights excluded."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: dict[int, int] = {}
        self.sizes: dict[int, int] = {}
        self.live = self.peak = 0

    def _release(self, key: int) -> None:
        self.refs[key] -= 1
        if not self.refs[key]:
            del self.refs[key]
            self.live -= self.sizes.pop(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (list, tuple)) else [out]:
            if isinstance(t, torch.Tensor):
                key = t.untyped_storage()._cdata
                if key not in self.refs:
                    self.refs[key], self.sizes[key] = 0, t.untyped_storage().nbytes()
                    self.live += self.sizes[key]
                    self.peak = max(self.peak, self.live)
                self.refs[key] += 1
                weakref.finalize(t, self._release, key)
        return out


def decode_peak_bytes(vae: nn.Module, latent: torch.Size | tuple[int, ...], dtype: torch.dtype) -> float:
    """Bytes alive at the peak of ``vae.decode`` of meta latents of ``latent`` shape (no grad, the VAE in
    ``dtype``): Wan's causal decoder keeps two frames of every convolution's input, at full resolution
    in its last stages, so a chunk of videos can outweigh the training pass."""
    return _vae_peak_bytes(vae, "decode", tuple(latent), dtype)


def decode_gradient_peak_bytes(vae: nn.Module, latent: torch.Size | tuple[int, ...], dtype: torch.dtype) -> float:
    """Bytes alive at the peak of ``vae.decode`` of meta latents of ``latent`` shape with grad, and of its
    backward to the latents (the VAE frozen, in ``dtype``): what a reward's gradient through the decoder takes
    beyond the reward itself."""
    return _vae_peak_bytes(vae, "decode_gradient", tuple(latent), dtype)


def encode_peak_bytes(vae: nn.Module, image: tuple[int, ...], dtype: torch.dtype) -> float:
    """Bytes alive at the peak of ``vae.encode`` of one meta image of ``image`` shape ``(1, 3, H, W)`` (no grad,
    the VAE in ``dtype``), as a policy's ``encode_images`` encodes them: one at a time."""
    return _vae_peak_bytes(vae, "encode", tuple(image), dtype)


#: what a meta decode's or encode's peak was, by direction, VAE class, config, input shape and dtype
_VAE_PEAKS: dict[tuple, float] = {}


def _vae_peak_bytes(vae: nn.Module, direction: str, shape: tuple[int, ...], dtype: torch.dtype) -> float:
    key = (direction, model_signature(vae), shape, str(dtype))
    if key not in _VAE_PEAKS:
        with diffusers_warnings_off():
            vae = vae.to(dtype)
        live = _LiveBytes()
        if direction == "decode_gradient":
            vae.requires_grad_(False)  # frozen: only the latents' gradient is taken
            latent = torch.zeros(*shape, device="meta", dtype=dtype, requires_grad=True)
            with torch.enable_grad(), live:
                images = vae.decode(latent, return_dict=False)[0]
                torch.autograd.grad(images.float().sum(), latent)
        else:
            with torch.no_grad(), live:
                run = vae.decode if direction == "decode" else vae.encode
                run(torch.zeros(*shape, device="meta", dtype=dtype), return_dict=False)
        _VAE_PEAKS[key] = float(live.peak)
    return _VAE_PEAKS[key]


def _encode_bytes(cfg: TrainConfig, spec: Any, models: dict[str, nn.Module], latent: Any, size: dict[str, Any]) -> float:
    """One image's encode peak at the model's size, for an image family whose transformer reads the VAE's
    latents as they are (``(B, C, H, W)``); 0 for the others (not sized)."""
    vae = models.get("vae")
    if vae is None or not hasattr(vae, "encode") or not isinstance(latent, torch.Tensor) or latent.ndim != 4:
        return 0.0
    import pipelines

    dtype = torch.float32 if spec.vae_float32 else pipelines.parse_dtype(cfg.model.dtype)
    try:
        return encode_peak_bytes(vae, (1, 3, int(size["height"]), int(size["width"])), dtype)
    except (RuntimeError, NotImplementedError, ValueError, TypeError):
        return 0.0


def _decode_bytes(cfg: TrainConfig, spec: Any, models: dict[str, nn.Module], latent: Any, samples: int,
                  gradient: bool = False) -> float:
    """The decode's peak for one chunk of ``samples`` rollouts where the transformer reads the VAE's latents as
    they are (``(B, C, H, W)`` or ``(B, C, F, H, W)`` with the VAE's channels: SD3, Wan text-to-video); a
    family that packs latents into tokens, or adds condition channels, is not sized (0). ``gradient``: the
    decode with grad and its backward, for exactly ``samples`` (a training chunk, as a reward gradient takes
    it), not the decode batch."""
    vae = models.get("vae")
    if vae is None or not hasattr(vae, "decode") or not isinstance(latent, torch.Tensor) or latent.ndim not in (4, 5):
        return 0.0
    channels = getattr(vae.config, "latent_channels", None) or getattr(vae.config, "z_dim", None)
    if latent.shape[1] != channels:
        return 0.0
    import pipelines

    chunk = samples if gradient else min(samples, cfg.model.decode_batch_size or spec.decode_batch)
    dtype = torch.float32 if spec.vae_float32 else pipelines.parse_dtype(cfg.model.dtype)
    peak = decode_gradient_peak_bytes if gradient else decode_peak_bytes
    try:
        return peak(vae, (chunk, *latent.shape[1:]), dtype)
    except (RuntimeError, NotImplementedError, ValueError, TypeError):
        return 0.0  # a decoder the meta device cannot run: the plan then sizes the training pass alone


def inspect_model(cfg: TrainConfig, folder: Path) -> Model:
    """Parameter counts and activation bytes of the config's model, built on the meta device; the family's
    spec (:mod:`flowalign.families`) gives its default size, guidance, LoRA targets and transformer inputs."""
    import pipelines

    from flowalign.parallel import block_modules

    spec = families.detect(folder) if cfg.model.family is None else families.get(cfg.model.family, "model.family")
    models = build_on_meta(folder)
    names = [c for c in spec.trained if c in models]
    with diffusers_warnings_off():
        for name in names:
            models[name] = models[name].to(pipelines.parse_dtype(cfg.model.dtype))
    transformer = models["transformer"]  # one step's forward runs one of the trained models
    blocks = block_modules(transformer)
    params = {name: sum(p.numel() for p in m.parameters()) for name, m in models.items()}
    lora_targets: dict[str, list[str]] = {}
    if cfg.model.finetune == "lora":
        from flowalign.lora_blocks import block_targets

        targets = list(cfg.model.lora.target_modules or spec.lora_targets)
        # shallow LoRA (model.lora.blocks): the adapter only on the chosen blocks' layers, named as the
        # policies name them to peft; a choice that fits no block is the policies' own one-line error
        lora_targets = {c: block_targets(models[c], targets, cfg.model.lora.blocks) for c in names}
        trained = {c: lora_parameters(models[c], lora_targets[c], cfg.model.lora.rank) for c in names}
    else:
        trained = {c: params[c] for c in names}
    largest = max((sum(p.numel() for p in b.parameters()) for c in names for b in block_modules(models[c])), default=0)
    size = {**spec.size, **_folder_defaults(folder), **{k: v for k, v in (cfg.model.defaults or {}).items() if v is not None},
            **_vae_scales(folder), **_text_lengths(folder)}
    trainer, tcfg = trainer_config(cfg.trainer)  # the section as the trainer reads it, its own defaults filled in
    per_sample = trainer.training_batch(tcfg)  # the trainer's batch (a CFG pass doubles it inside)
    guidance = getattr(tcfg, "guidance_scale", None) or size.get("guidance_scale") or spec.guidance
    twice = spec.guidance_kind(transformer.config, families.read_index(folder)) in ("cfg", "true_cfg") and float(guidance) > 1
    dtype = next(transformer.parameters()).dtype
    both = spec.transformer_inputs(transformer.config, per_sample * (2 if twice else 1), size, dtype=dtype)
    rollout = rollout_sample_bytes(both, per_sample, size)  # a rollout keeps both branches' conditioning
    policy_class = spec.policy_class(families.read_index(folder))
    kv_cache_bytes = getattr(policy_class, "kv_cache_bytes", None)
    if kv_cache_bytes is not None:  # a streaming model's rollout keeps the caches its chunks started from
        rollout = replace(rollout, kv_cache=kv_cache_bytes(transformer.config, size, dtype.itemsize))
    decode = _decode_bytes(cfg, spec, models, both.get("hidden_states"), per_sample)
    moments = trainer.step_holdings(tcfg).moments
    encodes = any(m.encoding for m in moments)  # images of its own (offline pairs)
    reward_gradient = (_decode_bytes(cfg, spec, models, both.get("hidden_states"), per_sample, gradient=True)
                       if any(m.reward_gradient for m in moments) else 0.0)
    # the rows that carry gradients in the training forward: the conditional half alone under a detached CFG
    rows = per_sample * (2 if twice and trainer.grads_through_unconditional(tcfg) else 1)
    inputs = both if rows == per_sample * (2 if twice else 1) else \
        spec.transformer_inputs(transformer.config, rows, size, dtype=dtype)
    chunks = trainer.training_chunks(tcfg, cfg.model.gradient_checkpointing)
    chunk_frames_of = getattr(policy_class, "chunk_frames_of", None)
    if chunks is not None and chunk_frames_of is not None:  # a streaming trainer's graph: rows of one chunk each
        frames = chunk_frames_of(transformer.config, size)
        one_chunk = {**size, "num_frames": (frames - 1) * int(size.get("vae_scale_temporal") or 4) + 1,
                     "chunk_partition": [frames]}
        rows = chunks * (2 if twice and trainer.grads_through_unconditional(tcfg) else 1)
        inputs = spec.transformer_inputs(transformer.config, rows, one_chunk, dtype=dtype)
    lora = None
    if cfg.model.finetune == "lora":
        lora = (tuple(lora_targets.get("transformer", targets)), cfg.model.lora.rank, cfg.model.lora.alpha,
                cfg.model.lora.compute_dtype)
    key = (*_forward_key(transformer, inputs), lora)
    act = _FORWARDS.get(key)
    if act is None and lora is not None:
        if not sum(trained.values()):
            raise UserError(f"model.lora.target_modules {list(targets)} match no linear layer of the {spec.name} "
                            f"transformer: name its attention projections (default {list(spec.lora_targets)})")
        add_lora_on_meta(transformer, list(lora[0]), lora[1], lora[2], lora[3])
    try:
        act = act or saved_activation_bytes(transformer, blocks, inputs)
    except (RuntimeError, NotImplementedError, ValueError) as err:
        # a value-dependent op (.item(), boolean token gathers) or a kernel with no meta implementation
        # (flex attention's block-causal masks)
        raise UserError(f"flowalign plan cannot size the {spec.name} transformer on the meta device: its forward "
                        f"depends on tensor values or on kernels the meta device lacks "
                        f"({str(err).splitlines()[0][:100]}). Size the run on a GPU with a real forward "
                        "instead") from None
    _FORWARDS[key] = act
    while len(_FORWARDS) > 64:  # a long-lived process planning many configs keeps the newest
        _FORWARDS.pop(next(iter(_FORWARDS)))
    per = lambda v: v / per_sample
    return Model(spec.name, params, trained, largest, Activations(per(act.outside), per(act.in_blocks),
                                                                  per(act.largest_block), per(act.block_inputs)),
                 rollout, twice, decode, 4 if spec.vae_float32 else 0,
                 _encode_bytes(cfg, spec, models, both.get("hidden_states"), size) if encodes else 0.0,
                 reward_gradient)


#: what a meta forward saved, by :func:`_forward_key`: recipes of one model at one batch and size (a
#: process planning several) share the forward, the costly part of a plan
_FORWARDS: dict[tuple, Activations] = {}


def _forward_key(transformer: nn.Module, inputs: dict[str, Any]) -> tuple:
    """Everything a meta forward's saved bytes depend on: the class, its config, its dtype and the inputs'
    shapes and values (non-tensors)."""
    return model_signature(transformer), input_signature(inputs)


def rollout_sample_bytes(inputs: dict[str, Any], batch: int, size: dict[str, Any]) -> Rollout:
    """One rollout sample's latent (the transformer's ``hidden_states``, or Z-Image's per-sample ``x``, in
    float32), its conditioning (every other input with a row per pass: text embeddings, pooled
    projections, masks; both CFG branches when the passes are twice the samples) and its decoded
    ``3 × H × W`` (× frames) float32 pixels, from the inputs of ``batch`` samples."""
    latent = inputs.get("hidden_states", inputs.get("x"))
    tensors = latent if isinstance(latent, (list, tuple)) else [latent]
    rows = len(tensors) if isinstance(latent, (list, tuple)) else latent.shape[0]
    latent_floats = sum(t.numel() for t in tensors) / rows
    conditioning = 0
    for key, value in inputs.items():
        if key in ("hidden_states", "x"):
            continue
        if isinstance(value, (list, tuple)) and len(value) == rows:  # one tensor per pass (Z-Image's captions)
            conditioning += sum(t.nbytes for t in value if isinstance(t, torch.Tensor))
        elif isinstance(value, torch.Tensor) and value.ndim >= 2 and value.shape[0] == rows:
            conditioning += value.nbytes  # per-pass rows; timesteps and position ids are rebuilt at every call
    pixels = 3 * int(size["height"]) * int(size["width"]) * int(size.get("num_frames") or 1)
    return Rollout(4 * latent_floats, conditioning / batch, 4 * pixels)


def _folder_defaults(folder: Path) -> dict[str, Any]:
    path = folder / "flowalign.json"
    data = json.loads(path.read_text()) if path.is_file() else {}
    return {k: v for k, v in data.items()
            if k in ("height", "width", "num_frames", "max_sequence_length", "guidance_scale", "chunk_frames",
                     "chunk_partition", "attention_window", "cache_frames") and v}


def _read_json(path: Path) -> dict[str, Any]:
    data = json.loads(path.read_text()) if path.is_file() else {}
    return data if isinstance(data, dict) else {}


def _positive_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


def _vae_scales(folder: Path) -> dict[str, int]:
    """The VAE's spatial and temporal factors where its config states them (Wan's VAE; a tiny twin's
    differ from the released 8 and 4), or, for an ``AutoencoderKL``, the spatial factor its
    ``block_out_channels`` give as diffusers' pipelines compute it (``2^(levels − 1)``: the tiny SD3's 4, the
    released 8), as ``vae_scale_spatial`` / ``vae_scale_temporal`` for the family's ``transformer_inputs``."""
    data = _read_json(folder / "vae" / "config.json")
    spatial = data.get("scale_factor_spatial")
    levels = data.get("block_out_channels")
    if spatial is None and isinstance(levels, list) and levels:
        spatial = 2 ** (len(levels) - 1)
    scales = {"vae_scale_spatial": spatial, "vae_scale_temporal": data.get("scale_factor_temporal")}
    return {k: v for k, v in scales.items() if _positive_int(v)}


def _text_lengths(folder: Path) -> dict[str, int]:
    """The CLIP encoder's token count, as diffusers' SD3 pipeline pads to it: the tokenizer's
    ``model_max_length``, else the encoder's ``max_position_embeddings`` (a folder of configs without
    tokenizers), as ``clip_tokens`` for the family's ``transformer_inputs`` (a tiny twin's 48, the released
    77); none where neither says."""
    encoder = _read_json(folder / "text_encoder" / "config.json").get("max_position_embeddings")
    tokens = _read_json(folder / "tokenizer" / "tokenizer_config.json").get("model_max_length")
    if not _positive_int(tokens) or (_positive_int(encoder) and tokens > encoder):  # a tokenizer's "no limit"
        tokens = encoder
    return {"clip_tokens": tokens} if _positive_int(tokens) else {}


def memory_rows(model: Model, s: Settings) -> dict[str, float]:
    """Bytes per rank by kind for one strategy (see the module docstring)."""
    n = s.gpus if s.strategy == "fsdp" else 1
    w = BYTES[s.dtype]
    train_bytes = 4 if s.finetune == "lora" else w  # LoRA tensors are kept in fp32
    base = model.trained_weights * w
    gathered = 2 * model.largest_block * w if s.strategy == "fsdp" else 0
    on_gpu = 0 if (s.cpu_offload and s.strategy == "fsdp") else 1
    lora = model.trainable * 4 if s.finetune == "lora" else 0
    activations = s.batch_size * model.activations.per_rank(s.gradient_checkpointing, s.sequence_parallel)
    gradients = model.trainable * train_bytes / n
    # what swapped_in keeps of the live trained tensors (this rank's shards), outside the update
    swapped = model.trainable * train_bytes / n if s.swapped_in else 0.0
    held = s.held_bytes(model.rollout)
    return {
        "weights (trained model)": (base + lora) / n * on_gpu + gathered,
        "gradients": gradients,
        "optimiser state (AdamW)": 2 * model.trainable * train_bytes / n * on_gpu,
        "reference / EMA copies": s.extra_copies * model.trainable * train_bytes / n,
        "teacher / critic models": s.model_copies * model.trained_weights * w + 16 * s.own_params,
        "frozen text encoders + VAE": sum(v * (model.vae_bytes_per_param or w if k == "vae" else w)
                                          for k, v in model.params.items() if k not in model.trained
                                          and not (s.offload_text_encoders and k.startswith("text_encoder"))),
        "frozen reward models": s.frozen_rewards,  # whole on every rank, under fsdp too
        "activations": activations,
        # sampling's and scoring's peak: decoding a chunk, under swapped-in weights with the live ones kept,
        # and what a trainer's own collect holds at once, while the gradients are freed (the optimiser's
        # state stays); above what the step keeps through the update
        "sampling, above the update's peak": max(0.0, s.outside_update_bytes(model.rollout, model.decode, swapped,
                                                                         model.encode, model.reward_gradient)
                                                 - held - activations - gradients),
        "rollouts of the step": held,
        "overhead (CUDA context, allocator)": OVERHEAD_BYTES,
    }


def predicted_rows(cfg: TrainConfig, folder: Path, strategy: str = "ddp", gpus: int = 1) -> dict[str, float]:
    """Bytes per rank by kind that ``flowalign plan`` predicts for ``cfg`` on ``folder`` (their sum is the
    predicted peak, to set against a run's measured ``torch.cuda.max_memory_allocated``)."""
    model = inspect_model(cfg, folder)
    return memory_rows(model, settings(cfg, strategy, gpus, model))


def smallest_fix(model: Model, s: Settings, limit: float, trainer_fields: Collection[str] = ("batch_size",
                                                                                          "prompts_per_step"),
                 fsdp: bool = True) -> str | None:
    """The first single change (least disruptive first) after which the run fits, or None; a trainer setting
    is suggested only to a trainer that has it (``trainer_fields``), and fsdp only where the trainer takes it
    (``fsdp``: :func:`fsdp_refusal`)."""
    candidates: list[tuple[str, Settings]] = []
    if not s.gradient_checkpointing:
        candidates.append(("model.gradient_checkpointing=true", replace(s, gradient_checkpointing=True)))
    if not s.offload_text_encoders:
        candidates.append(("model.offload_text_encoders=true", replace(s, offload_text_encoders=True)))
    if s.strategy == "ddp" and s.gpus > 1 and fsdp:
        candidates.append(("parallel.strategy=fsdp", replace(s, strategy="fsdp")))
    if s.strategy == "fsdp" and not s.cpu_offload:
        candidates.append(("parallel.cpu_offload=true", replace(s, cpu_offload=True)))
    b = s.batch_size // 2 if "batch_size" in trainer_fields else 0
    while b >= 1:
        candidates.append((f"trainer.batch_size={b}", replace(s, batch_size=b)))
        b //= 2
    p = s.prompts_per_step // 2 if "prompts_per_step" in trainer_fields else 0
    while p >= 1:  # fewer rollouts held for the update
        candidates.append((f"trainer.prompts_per_step={p}", replace(s, prompts_per_step=p)))
        p //= 2
    degree = 2 * s.sequence_parallel
    while s.gpus % degree == 0:  # each sample's tokens over more of the GPUs
        candidates.append((f"parallel.sequence_parallel={degree}", replace(s, sequence_parallel=degree)))
        degree *= 2
    if fsdp:  # more GPUs help a ddp rank only through fsdp's shards
        candidates.append((f"--gpus {s.gpus * 2} with parallel.strategy=fsdp",
                           replace(s, strategy="fsdp", gpus=s.gpus * 2)))
    for text, changed in candidates:
        if sum(memory_rows(model, changed).values()) <= limit:
            return text
    return None


def fsdp_refusal(cfg: TrainConfig) -> str | None:
    """The trainer's own line refusing ``parallel.strategy: fsdp`` for ``cfg``, or None where it takes it: its
    ``check_config`` (where a trainer refuses what it cannot honour) run on ``cfg`` under ddp and under fsdp,
    refused where only fsdp is (a config the trainer refuses anyway is not the strategy's doing)."""
    import contextlib
    import io

    trainer, tcfg = trainer_config(cfg.trainer)

    def refusal(strategy: str) -> str | None:
        changed = cfg.model_copy(update={"parallel": cfg.parallel.model_copy(update={"strategy": strategy})})
        try:
            with contextlib.redirect_stdout(io.StringIO()):  # its warnings are the run's to print, not the plan's
                trainer.check_config(changed, tcfg)
        except UserError as err:
            return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        return None

    return refusal("fsdp") if refusal("ddp") is None else None


def settings(cfg: TrainConfig, strategy: str, gpus: int, model: Model | None = None) -> Settings:
    """What the memory of ``cfg`` depends on under one strategy, read from the trainer's section as the
    trainer reads it (its own defaults filled in); ``model`` tells whether CFG doubles the passes."""
    trainer, tcfg = trainer_config(cfg.trainer)
    copies = trainer.weight_copies(cfg, tcfg)
    prompts, group, steps = trainer.rollouts_per_step(tcfg)
    holdings = trainer.step_holdings(tcfg)
    if holdings.samples_per_prompt is not None:
        group = holdings.samples_per_prompt
    extra = device_copies(copies, "trained") + int(tcfg.ema_decay > 0)
    stored = float(trainer.keeps_velocities(tcfg))
    # the EMA's weights are swapped in for evaluation, which samples and decodes too
    swapped = (swaps_in(copies) if holdings.swaps is None else holdings.swaps) or tcfg.ema_decay > 0
    if not trainer.grads_through_unconditional(tcfg) and model is not None and model.cfg_doubles:
        stored += BYTES[cfg.model.dtype] / 4  # CFG's unconditional branch, in the model's dtype
    return Settings(strategy, gpus, cfg.parallel.cpu_offload, cfg.model.finetune, cfg.model.dtype,
                    cfg.model.gradient_checkpointing, trainer.training_batch(tcfg), extra, device_copies(copies, "model"),
                    cfg.model.offload_text_encoders, cfg.parallel.sequence_parallel,
                    prompts_per_step=prompts, group_size=group, num_steps=steps, stored_velocities=stored,
                    own_params=device_own_params(copies), swapped_in=swapped, holdings=holdings,
                    frozen_rewards=float(frozen_models(cfg).total))


def human(n: float, unit: str = "") -> str:
    """``11.90B`` / ``83.65M`` for counts, ``23.8 GB`` for bytes."""
    if unit == "GB":
        return f"{n / GB:.1f} GB"
    for div, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.2f}{suffix}"
    return str(int(n))


def reward_lines(frozen: FrozenModels) -> list[str]:
    """The plan's lines on the frozen reward models: each one's bytes per rank, and each one not counted with
    why (none where the run loads none)."""
    held = [f"{label} {size / GB:.2f} GB" for label, size in frozen.counted.items() if size]
    free = [label for label, size in frozen.counted.items() if not size]
    lines = []
    if frozen.counted:
        lines.append("frozen reward models per rank: " + (", ".join(held) if held else "none on the GPU")
                     + (f" ({'nothing on the GPU: ' if held else ''}{', '.join(free)})" if free else ""))
    lines += [f"  not counted: {label} ({why})" for label, why in frozen.not_counted.items()]
    return lines


def plan_text(cfg: TrainConfig, folder: Path, gpus: int, gpu_memory_gb: float, note: str | None = None) -> str:
    """The report ``flowalign plan`` prints: ``note`` (e.g. which published architecture stands in for
    ``model.path``) first, components, the step's rollouts, then memory per rank for ddp and fsdp, verdicts."""
    sp = cfg.parallel.sequence_parallel
    if gpus % sp:
        raise UserError(f"parallel.sequence_parallel={sp} must divide --gpus {gpus}")
    model = inspect_model(cfg, folder)
    base = settings(cfg, "ddp", gpus, model)
    lines = [note] if note else []
    lines.append(f"model {folder} ({model.family}), finetune {cfg.model.finetune}, dtype {cfg.model.dtype}, "
                 f"trainer {cfg.trainer.get('name', 'flow_grpo')}, batch {base.batch_size} per rank"
                 + (f", tokens split over {sp} sequence ranks" if sp > 1 else ""))
    for name, count in model.params.items():
        role = f"trained: {human(model.trained[name])}" if name in model.trained else "frozen"
        lines.append(f"  {name:<16} {human(count):>8}  ({role})")
    lines += reward_lines(frozen_models(cfg))
    if base.samples:
        one = replace(base, prompts_per_step=1, group_size=1).rollout_bytes(model.rollout)
        lines.append(f"rollouts a step per rank: {base.prompts_per_step} prompts x {base.group_size} = {base.samples:,} "
                     f"samples of {base.num_steps} steps, {one / 1e6:.1f} MB each (latents of every step"
                     + (", stored velocities" if base.stored_velocities else "") + ", log-probs, conditioning, decoded)")
    refused = fsdp_refusal(cfg)
    strategies = ["ddp", "fsdp"] if gpus > 1 and refused is None else ["ddp"]
    rows = {s: memory_rows(model, settings(cfg, s, gpus, model)) for s in strategies}
    limit = gpu_memory_gb * GB
    lines.append(f"memory per rank on {gpus} GPU(s) of {gpu_memory_gb:g} GB"
                 + ("" if gpus > 1 else " (fsdp needs 2 or more)"))
    lines.append(f"  {'':<36}" + "".join(f"{s:>12}" for s in strategies))
    for kind in rows[strategies[0]]:
        lines.append(f"  {kind:<36}" + "".join(f"{human(rows[s][kind], 'GB'):>12}" for s in strategies))
    totals = {s: sum(r.values()) for s, r in rows.items()}
    lines.append(f"  {'total':<36}" + "".join(f"{human(totals[s], 'GB'):>12}" for s in strategies))
    lines.append(CALIBRATION)
    if refused:
        lines.append(f"fsdp: not planned, the trainer refuses it ({refused})")
    for s in strategies:
        if totals[s] <= limit:
            lines.append(f"{s}: fits ({human(limit - totals[s], 'GB')} to spare)")
        else:
            fix = smallest_fix(model, settings(cfg, s, gpus, model), limit, type(trainer_config(cfg.trainer)[1]).model_fields,
                               fsdp=refused is None)
            lines.append(f"{s}: does not fit; " + (f"smallest change that fits: {fix}" if fix else
                                                    "no single change fits (use more or larger GPUs, or LoRA)"))
    return "\n".join(lines)
