"""Small helpers the family policies share: their options, the constructor steps every family takes
(load the pipeline frozen, merge sampling defaults, set up training), prompt checks, σ → timestep and
the per-prompt embedding cache.

Kept deliberately thin: everything model-specific stays in the family files.
"""

from __future__ import annotations

import difflib
import json
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from flowalign.data import check_prompt_length
from flowalign.errors import UserError
from flowalign.protocols import Conditioning
from flowalign.sampling.inputs import load_input_image
from flowalign.sampling.steps import batch_values
from pipelines import lora as lora_utils
from pipelines import prompt_warnings
from pipelines.tiny import read_sampling_defaults


def check_prompts(prompts: Any) -> list[str]:
    """``prompts`` must be a non-empty list (or tuple) of str: a bare str would be split into letters."""
    if isinstance(prompts, str):
        raise UserError(f"prompts must be a list of strings, got the str {prompts[:40]!r}: wrap it as [prompt]")
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise UserError(f"prompts must be a non-empty list of strings, got {prompts!r:.60}")
    bad = sorted({type(p).__name__ for p in prompts if not isinstance(p, str)})
    if bad:
        raise UserError(f"prompts must hold only strings, found {', '.join(bad)}")
    for i, prompt in enumerate(prompts):
        check_prompt_length(prompt, f"prompts[{i}]")
    prompt_warnings.install()  # one short line for a prompt the text encoders cut, not one per encoder
    return list(prompts)


def batch_size(x: torch.Tensor, cond: Conditioning) -> int:
    """B, the batch of ``x`` ``(B, ...)``, checked against the conditioning's."""
    if len(cond) != x.shape[0]:
        raise ValueError(f"velocity: x has batch {x.shape[0]} but cond has {len(cond)} prompts")
    return x.shape[0]


def sigma_batch(sigma: float | torch.Tensor, batch: int, device: torch.device) -> torch.Tensor:
    """σ as a float32 ``(B,)`` tensor on ``device`` (σ a float, a one-value or a ``(B,)`` tensor), made without
    waiting for the device (:func:`flowalign.sampling.steps.batch_values`)."""
    if isinstance(sigma, torch.Tensor):
        sigma = sigma.flatten()
        sigma = sigma[0] if sigma.numel() == 1 else sigma  # one value: 0-d, filled in on the device
    s = batch_values(sigma, batch, device)
    if s.numel() != batch:
        raise ValueError(f"sigma has {s.numel()} values for a batch of {batch}")
    return s


def gaussian_noise(shape: tuple[int, ...], generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """Standard normal float32 noise of ``shape`` on ``device``, drawn on the generator's device (CPU when
    None) as diffusers' ``randn_tensor`` does, so a seed gives the pipeline's own latents."""
    rand_device = generator.device if generator is not None else torch.device("cpu")
    return torch.randn(shape, generator=generator, device=rand_device, dtype=torch.float32).to(device, non_blocking=True)


def sampling_defaults(path: str | Path) -> dict[str, Any]:
    """The folder's ``flowalign.json`` (sampling defaults) without its ``family`` tag and null values."""
    try:
        data = read_sampling_defaults(path) or {}
    except json.JSONDecodeError as err:
        raise UserError(f"{Path(path) / 'flowalign.json'} is not valid JSON ({err}): fix or delete it") from err
    return {k: v for k, v in data.items() if k != "family" and v is not None}


class PromptCache:
    """Per-prompt text embeddings, least recently used evicted beyond ``max_size`` prompts.

    Training reuses a prompt set over and over; the text encoders (T5-XXL for SD3/FLUX, UMT5 for Wan)
    cost more than a transformer step, so each prompt string is encoded once (the CFG negative, the
    empty prompt, too). Rows are stored on the policy's device in the model dtype (SD3.5: ~2.7 MB per
    prompt in bf16).

    The rows stay valid only while the ``encoders`` are frozen and unchanged: while any of their
    tensors requires grad (the text encoder is being trained) nothing is cached and embeddings carry
    gradients; when their weights changed in place (an optimiser step, ``load_state_dict``) or were
    replaced, the rows are dropped. Checked on every lookup from the tensors' version counters.

    Each new prompt is encoded on its own (a batch of one), so its embedding is a function of the string
    alone. Float kernels are not batch-invariant: batched with other prompts, the same prompt can come
    out different in the last bits, and a run resumed from a checkpoint first meets a prompt in another
    batch than the uninterrupted run did, which broke bit-identical resume
    (tests/flowalign/trainers/test_resume.py) when new prompts were encoded 32 at a time.
    """

    def __init__(self, max_size: int = 1024, encoders: Sequence[torch.nn.Module] = ()) -> None:
        self.max_size = max_size
        self.encoders = [m for m in encoders if m is not None]
        self.rows: OrderedDict[str, dict[str, torch.Tensor]] = OrderedDict()
        self._weights_seen: list[tuple[int, int]] | None = None

    def usable(self) -> bool:
        """False while an encoder trains; drops the rows when the encoders' weights changed since last use."""
        params = [p for m in self.encoders for p in m.parameters()]
        if any(p.requires_grad for p in params):
            self.rows.clear()
            return False
        seen = [(id(p), p._version) for p in params]
        if seen != self._weights_seen:
            self.rows.clear()
            self._weights_seen = seen
        return True

    def lookup(
        self, prompts: list[str], encode: Callable[[list[str]], dict[str, torch.Tensor]]
    ) -> dict[str, dict[str, torch.Tensor]]:
        """Rows for every distinct prompt; ``encode([prompt]) -> {name: (1, ...)}`` runs on each missing one.

        Returned rows are per prompt, without a batch dimension.
        """
        wanted = list(dict.fromkeys(prompts))
        if not self.usable():
            return {p: {k: v[0] for k, v in encode([p]).items()} for p in wanted}
        found = {p: self.rows[p] for p in wanted if p in self.rows}
        for p in wanted:
            if p not in found:
                with torch.no_grad():
                    found[p] = {k: v[0] for k, v in encode([p]).items()}
            self.rows[p] = found[p]
            self.rows.move_to_end(p)
        while len(self.rows) > self.max_size:
            self.rows.popitem(last=False)
        return found


def stack_rows(rows: dict[str, dict[str, torch.Tensor]], prompts: list[str], keys: Sequence[str]) -> dict[str, torch.Tensor]:
    """``{key: (B, ...)}`` from per-prompt rows, in the order of ``prompts``."""
    return {k: torch.stack([rows[p][k] for p in prompts]) for k in keys}


@dataclass
class PolicyOptions:
    """The keyword options every family policy takes (``pipelines.load`` passes them through).

    ``lora={"rank", "alpha", "target_modules", "dropout", "init"}`` adds a trainable peft LoRA;
    ``full_finetune`` trains every transformer weight; neither: frozen. ``defaults`` override the
    sampling defaults (over the folder's ``flowalign.json``).
    """

    device: str | torch.device = "cpu"
    dtype: torch.dtype = torch.float32
    lora: dict[str, Any] | None = None
    full_finetune: bool = False
    gradient_checkpointing: bool = False
    defaults: dict[str, Any] | None = None
    prompt_cache_size: int = 1024
    decode_batch_size: int = 8

    @classmethod
    def parse(cls, options: dict[str, Any], **family_defaults: Any) -> PolicyOptions:
        """Options over the family's own defaults; unknown names and contradictory training options are
        refused here, before minutes of loading a real checkpoint."""
        unknown = sorted(set(options) - {f.name for f in fields(cls)})
        if unknown:
            raise UserError(f"unknown policy option(s) {unknown}: allowed are {sorted(f.name for f in fields(cls))}")
        opts = cls(**{**family_defaults, **options})
        lora_utils.check_options(opts.lora, opts.full_finetune)
        return opts


def load_frozen_pipeline(pipeline_class: type, path: str | Path, options: PolicyOptions, **kwargs: Any) -> Any:
    """``pipeline_class.from_pretrained(path)`` in the options' dtype on their device, progress bar off,
    every component frozen (:func:`pipelines.lora.freeze`); ``kwargs`` go to ``from_pretrained``."""
    pipe = pipeline_class.from_pretrained(str(path), dtype=options.dtype, **kwargs).to(torch.device(options.device))
    pipe.set_progress_bar_config(disable=True)
    for module in pipe.components.values():
        if isinstance(module, torch.nn.Module):
            lora_utils.freeze(module)
    return pipe


def load_with_float32_vae(pipeline_class: type, vae_class: type, path: str | Path, options: PolicyOptions) -> Any:
    """:func:`load_frozen_pipeline` with the video VAE (a ``vae_class``) in float32 whatever the model dtype, as
    diffusers' video examples load it (causal 3D convolutions lose detail in bf16)."""
    vae = vae_class.from_pretrained(str(path), subfolder="vae", dtype=torch.float32)
    return load_frozen_pipeline(pipeline_class, path, options, vae=vae)


def open_pipeline(policy: Any, pipeline_class: type, path: str | Path, options: dict[str, Any], *,
                  float32_vae: type | None = None, **option_defaults: Any) -> PolicyOptions:
    """How every family's ``__init__`` starts: ``policy.options`` (:meth:`PolicyOptions.parse` of ``options``
    over ``option_defaults``), ``policy.device`` and ``policy.dtype`` from them, ``policy.pipe`` (the frozen
    ``pipeline_class`` at ``path``; with ``float32_vae``, that video VAE class loaded in float32,
    :func:`load_with_float32_vae`) and its ``transformer`` and ``vae`` on the policy. Returns the options."""
    policy.options = opts = PolicyOptions.parse(options, **option_defaults)
    policy.device, policy.dtype = torch.device(opts.device), opts.dtype
    policy.pipe = (load_frozen_pipeline(pipeline_class, path, opts) if float32_vae is None
                   else load_with_float32_vae(pipeline_class, float32_vae, path, opts))
    policy.transformer, policy.vae = policy.pipe.transformer, policy.pipe.vae
    return opts


def require_scheduler(pipe: Any, scheduler_class: type, path: str | Path, model: str) -> None:
    """Refuse a folder whose scheduler is not a ``scheduler_class`` (the one ``model``'s folders ship, whose σ
    grid the policy reproduces)."""
    if not isinstance(pipe.scheduler, scheduler_class):
        raise UserError(f"{path}: scheduler {type(pipe.scheduler).__name__} is not supported; {model} folders ship "
                        f"{scheduler_class.__name__}")


#: the model.defaults keys every family reads; a policy class states its own as ``sampling_keys``
SAMPLING_KEYS = frozenset({"height", "width", "num_frames", "num_steps", "guidance_scale", "max_sequence_length",
                           "shift"})


def merge_defaults(builtin: dict[str, Any], path: str | Path, caller: dict[str, Any] | None) -> dict[str, Any]:
    """Sampling defaults: what the checkpoint itself implies, then ``flowalign.json``, then the caller's."""
    return {**builtin, **sampling_defaults(path), **(caller or {})}


def check_sampling_defaults(policy_class: type, path: str | Path, caller: dict[str, Any] | None, family: str) -> None:
    """Refuse a caller's sampling default that ``policy_class`` does not read (a misspelt ``heigth``), in one line
    naming it, the nearest key and the family's keys: its ``sampling_keys`` and those of the folder's
    ``flowalign.json``. A policy class without ``sampling_keys`` (a plugin's own) is not checked."""
    keys = getattr(policy_class, "sampling_keys", None)
    if keys is None:
        return
    known = sorted(set(keys) | set(sampling_defaults(path)))
    unknown = sorted(set(caller or {}) - set(known))
    if unknown:
        close = difflib.get_close_matches(unknown[0], known, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise UserError(f"model.defaults.{unknown[0]}: not a sampling default of the {family} family: {hint}give one "
                        f"of {', '.join(known)}")


def check_multiple(defaults: dict[str, Any], multiples: dict[str, int], model: str) -> None:
    """Refuse a default (``height``, ``width``) that is not a multiple of what ``model`` needs."""
    for key, multiple in multiples.items():
        if int(defaults[key]) % multiple:
            raise UserError(f"{key}={defaults[key]} must be a multiple of {multiple} for {model}")


def check_choice(defaults: dict[str, Any], key: str, choices: tuple[Any, ...]) -> None:
    """Refuse a sampling default ``key`` that is none of ``choices`` (a family's switch between two forms)."""
    value = defaults[key]
    if not any(value is c if isinstance(c, bool) else value == c for c in choices):
        shown = ", ".join("true" if c is True else "false" if c is False else str(c) for c in choices)
        raise UserError(f"model.defaults.{key}={value!r}: give one of {shown}")


def check_side_multiple(defaults: dict[str, Any], multiple: int, model: str) -> None:
    """Refuse a default ``height`` or ``width`` that is not a multiple of ``multiple`` (VAE factor × patch)."""
    check_multiple(defaults, {"height": multiple, "width": multiple}, model)


def sized_defaults(builtin: dict[str, Any], path: str | Path, caller: dict[str, Any] | None, multiple: int,
                   model: str) -> dict[str, Any]:
    """:func:`merge_defaults`, then :func:`check_side_multiple`: ``height``, ``width`` multiples of ``multiple``."""
    defaults = merge_defaults(builtin, path, caller)
    check_side_multiple(defaults, multiple, model)
    return defaults


def scheduler_shift(pipe: Any) -> float:
    """The ``shift`` of the pipeline's scheduler config (1.0 when it has none): the built-in default."""
    return float(pipe.scheduler.config.get("shift", 1.0))


def own_scheduler(pipe: Any, shift: float) -> FlowMatchEulerDiscreteScheduler:
    """The policy's own copy of the pipeline's flow-matching scheduler with ``shift`` set (the pipeline
    keeps its own untouched)."""
    return FlowMatchEulerDiscreteScheduler.from_config(pipe.scheduler.config, shift=float(shift))


#: LoRA targets of a joint-attention (MMDiT) block: the image stream's attention projections (to_*) and the
#: text stream's (add_* / to_add_out), as diffusers' SD3, FLUX and Qwen-Image LoRA recipes target them
JOINT_ATTENTION_LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj",
                                "to_add_out"]
#: LoRA targets of a block with one attention stream (self- and cross-attention projections alike)
ATTENTION_LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]


def chunk_slice(chunk_frames: Sequence[int], k: int) -> slice:
    """A streaming policy's chunk ``k`` along the frame axis, its chunks being ``chunk_frames`` frames long."""
    start = sum(chunk_frames[:k])
    return slice(start, start + chunk_frames[k])


def check_num_steps(num_steps: int) -> int:
    """``num_steps`` as an int, refused below 1 (a σ grid needs at least one step)."""
    n = int(num_steps)
    if n < 1:
        raise UserError(f"num_steps must be >= 1, got {num_steps}")
    return n


def pack_2x2(z: torch.Tensor) -> torch.Tensor:
    """Latents ``(B, C, h, w)`` (or one frame, ``(B, C, 1, h, w)`` or ``(B, 1, C, h, w)``) → tokens
    ``(B, (h/2)·(w/2), 4·C)`` of 2×2 patches, channel-major within a patch: the packing of FLUX.1's and
    Qwen-Image's pipelines."""
    b, h, w = z.shape[0], z.shape[-2], z.shape[-1]
    c = z.numel() // (b * h * w)  # the frame axis (size 1) may sit before or after the channels
    z = z.reshape(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return z.reshape(b, (h // 2) * (w // 2), c * 4)


# Copied from diffusers.pipelines.flux.pipeline_flux.FluxPipeline._prepare_latent_image_ids
def latent_image_ids(height: int, width: int, device: torch.device | str, dtype: torch.dtype) -> torch.Tensor:
    """Position ids ``(height·width, 3)`` of a ``height × width`` token grid: ``(0, row, column)`` per token,
    row-major, as FLUX.1's pipelines give the transformer (``img_ids``). A copy of diffusers' private static
    method, so that no family calls a private name; a test keeps the two identical."""
    latent_image_ids = torch.zeros(height, width, 3)
    latent_image_ids[..., 1] = latent_image_ids[..., 1] + torch.arange(height)[:, None]
    latent_image_ids[..., 2] = latent_image_ids[..., 2] + torch.arange(width)[None, :]

    latent_image_id_height, latent_image_id_width, latent_image_id_channels = latent_image_ids.shape

    latent_image_ids = latent_image_ids.reshape(
        latent_image_id_height * latent_image_id_width, latent_image_id_channels
    )

    return latent_image_ids.to(device=device, dtype=dtype)


def held(owner: Any, name: str, key: Any, make: Callable[[], torch.Tensor]) -> torch.Tensor:
    """``make()``, kept on ``owner`` (a policy, a reward) as ``name`` while ``key`` stays the same. For the
    position ids a transformer takes at every call: made on the host, they would be copied to the device at
    every call, and a copy from the host makes the host wait for the work queued on a GPU. Shared between
    calls: never write into it."""
    kept = getattr(owner, name, None)
    if kept is None or kept[0] != key:
        kept = (key, make())
        setattr(owner, name, kept)
    return kept[1]


def grid_ids(owner: Any, height: int, width: int, device: torch.device | str, dtype: torch.dtype) -> torch.Tensor:
    """:func:`latent_image_ids` of a ``height × width`` grid on ``device``, kept on ``owner`` (:func:`held`)."""
    return held(owner, "_grid_ids", (height, width, torch.device(device), dtype),
                lambda: latent_image_ids(height, width, device, dtype))


def vae_latent_stats(policy: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The policy's VAE ``latents_mean`` and ``latents_std`` (Wan's VAE, Qwen-Image's), each float32
    ``(1, z_dim, 1, 1, 1)`` on the policy's device, kept on the policy (:func:`held`)."""
    config, device = policy.vae.config, policy.device
    shape = (1, config.z_dim, 1, 1, 1)
    return (held(policy, "_latents_mean", device, lambda: torch.tensor(config.latents_mean, device=device).view(shape)),
            held(policy, "_latents_std", device, lambda: torch.tensor(config.latents_std, device=device).view(shape)))


def unpack_2x2(tokens: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """The inverse of :func:`pack_2x2`: tokens ``(B, (h/2)·(w/2), 4·C)`` → latents ``(B, C, h, w)``."""
    b, _, channels = tokens.shape
    z = tokens.reshape(b, h // 2, w // 2, channels // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return z.reshape(b, channels // 4, h, w)


def resize_input(image: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """An input image ``(3, H, W)`` in [0, 1] at the output size (bilinear, antialiased), as the editing and
    image-to-video policies encode it; the tiny editing model's pretraining prepares its source images with it."""
    if tuple(image.shape[-2:]) == (height, width):
        return image
    return torch.nn.functional.interpolate(image[None], size=(height, width), mode="bilinear", antialias=True,
                                           align_corners=False)[0].clamp(0, 1)


def vae_unscale(vae: Any, z: torch.Tensor) -> torch.Tensor:
    """Model-space latents → the VAE's: ``z / scaling_factor + shift_factor`` in the VAE's dtype."""
    return z.to(vae.dtype) / vae.config.scaling_factor + (vae.config.shift_factor or 0.0)


def decode_in_chunks(vae: Any, x0: torch.Tensor, chunk_size: int,
                     to_vae_latents: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``vae.decode`` of ``to_vae_latents(chunk)`` for chunks of ``chunk_size`` samples of ``x0``, as float32
    in [0, 1] (``(B, 3, ...)``, concatenated). Differentiable in ``x0``: the VAE is frozen, not detached."""
    out = []
    for chunk in x0.split(chunk_size):
        decoded = vae.decode(to_vae_latents(chunk), return_dict=False)[0]
        out.append((decoded.float() / 2 + 0.5).clamp(0, 1))
    return torch.cat(out)


def zeros_factory(device: str | torch.device, dtype: torch.dtype) -> Callable[..., torch.Tensor]:
    """``new(*shape)``: zeros on ``device`` in ``dtype`` (the planner's stand-in inputs, meta by default)."""
    return lambda *shape: torch.zeros(*shape, device=device, dtype=dtype)


class PackedLatents:
    """The latent shapes of a family whose transformer takes 2×2 latent patches packed as tokens
    (FLUX.1, Qwen-Image), for a policy with ``defaults``, ``vae_scale_factor`` and ``transformer``."""

    defaults: dict[str, Any]
    vae_scale_factor: int
    transformer: torch.nn.Module

    @property
    def latent_hw(self) -> tuple[int, int]:
        """Unpacked latent ``(h, w)``: even, as the pipeline rounds them for 2×2 packing."""
        f = self.vae_scale_factor * 2
        return 2 * (int(self.defaults["height"]) // f), 2 * (int(self.defaults["width"]) // f)

    @property
    def latent_shape(self) -> tuple[int, int]:
        """Packed ``(seq, 4·C)`` of one sample, ``seq = (h/2)·(w/2)``."""
        h, w = self.latent_hw
        return (h // 2) * (w // 2), self.transformer.config.in_channels


def make_trainable(transformer: torch.nn.Module, options: PolicyOptions, default_targets: list[str]) -> torch.nn.Module:
    """LoRA, full fine-tuning or frozen as the options ask (:func:`pipelines.lora.setup_training`);
    returns the module whose ``requires_grad`` parameters the trainer optimises."""
    lora_utils.setup_training(
        transformer,
        lora=options.lora,
        full_finetune=options.full_finetune,
        default_targets=default_targets,
        gradient_checkpointing=options.gradient_checkpointing,
    )
    return transformer


def text_encoders(pipe: Any) -> list[torch.nn.Module]:
    """The pipeline's text encoders (``text_encoder``, ``text_encoder_2``, ...), for the prompt cache."""
    return [m for name, m in pipe.components.items() if name.startswith("text_encoder") and m is not None]


def _require_negatives(cond: Conditioning, keys: list[str], encoded_guidance: float) -> None:
    if any(f"negative_{k}" not in cond.tensors for k in keys):
        raise UserError(
            f"guidance > 1 needs CFG negatives, but cond was encoded with guidance_scale={encoded_guidance}: "
            "set defaults['guidance_scale'] > 1 before encode()"
        )


def cfg_batch(cond: Conditioning, keys: list[str], encoded_guidance: float, device: torch.device,
              dtype: torch.dtype) -> list[torch.Tensor]:
    """``[negative; positive]`` ``(2B, ...)`` for each of ``keys``: CFG's two halves as one transformer
    batch. ``encoded_guidance`` is the guidance scale the conditioning was encoded with (named in the
    error when the negatives are missing)."""
    _require_negatives(cond, keys, encoded_guidance)
    return [torch.cat([cond.tensors[f"negative_{k}"], cond.tensors[k]]).to(device, dtype) for k in keys]


def negative_conditioning(cond: Conditioning, keys: list[str], encoded_guidance: float) -> Conditioning:
    """The CFG negatives of ``cond`` as a conditioning of their own (for the unconditional velocity)."""
    _require_negatives(cond, keys, encoded_guidance)
    return Conditioning({k: cond.tensors[f"negative_{k}"] for k in keys}, [""] * len(cond))


def encode_with_empty_negative(cache: PromptCache, prompts: list[str],
                               encode: Callable[[list[str]], dict[str, torch.Tensor]], cfg: bool,
                               keys: Sequence[str] = ("prompt_embeds",)) -> Conditioning:
    """Each of ``keys`` (``(B, ...)``, the tensors ``encode`` returns per prompt) of ``prompts`` from ``cache``
    and, when ``cfg``, the empty prompt's as ``negative_<key>`` (encoded once, repeated B times): the CFG
    negative of a pipeline called with ``negative_prompt=None``."""
    rows = cache.lookup(prompts + [""] if cfg else prompts, encode)
    tensors = stack_rows(rows, prompts, keys)
    if cfg:
        tensors.update({f"negative_{k}": v for k, v in stack_rows(rows, [""] * len(prompts), keys).items()})
    return Conditioning(tensors, prompts)


def with_input_images(cond: Conditioning, images: list[Any] | None,
                      encode_image: Callable[[torch.Tensor], torch.Tensor], key: str, needs: str) -> Conditioning:
    """``cond`` plus ``key``: ``encode_image`` of each prompt's input image (read by
    :func:`flowalign.sampling.inputs.load_input_image`, ``(3, H, W)`` in [0, 1]), concatenated on the batch axis,
    without gradients. ``needs`` names what the images are for when their count is not one per prompt."""
    if images is None or len(images) != len(cond):
        raise UserError(f"{needs} per prompt ({len(cond)} prompts, {0 if images is None else len(images)} images)")
    with torch.no_grad():
        encoded = torch.cat([encode_image(load_input_image(image)) for image in images])
    return Conditioning({**cond.tensors, key: encoded}, cond.prompts)


def cfg_mix(v_uncond: torch.Tensor, v_cond: torch.Tensor, guidance: float) -> torch.Tensor:
    """``v_u + w·(v_c − v_u)`` float32 ``(B, ...)``.

    A policy's ``velocity(x, σ, cond, w, uncond=v_u)`` calls this with a ``v_u`` computed beforehand
    (``unconditional_velocity``, under ``no_grad`` or stored by a rollout): only the conditional half
    runs, as one forward of batch B, and only it carries gradients. That is the unconditional branch
    detached, as Flow-GRPO's reference trains, without paying a backward through the ``[uncond; cond]``
    batch. It is bit-identical to the batched pass only when the rollout computed its velocities the
    same way (float kernels are not batch-invariant).
    """
    v_uncond, v_cond = v_uncond.float(), v_cond.float()
    return v_uncond + guidance * (v_cond - v_uncond)


def cfg_combine(out: torch.Tensor, guidance: float) -> torch.Tensor:
    """:func:`cfg_mix` of a ``[uncond; cond]`` transformer output ``(2B, ...)``."""
    v_uncond, v_cond = out.chunk(2)
    return cfg_mix(v_uncond, v_cond, guidance)
