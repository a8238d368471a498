"""Latent Reward Registers: a reward read from noisy latents through a frozen DiT (``docs/methods/latent_registers.md``).

M learnable register tokens ride along a FROZEN transformer (SD3 / SD3.5, FLUX.1, Wan 2.1 / 2.2) as a
read-only path: register queries attend to every token of each block, image, video and text queries
never see a register. The generator is therefore untouched (its velocity is bit-identical with and
without the registers), and the reward costs one DiT forward plus a thin stream of M tokens.

Implementation (the method page's "cheap equivalent"): the transformer runs its own, unmodified ``forward``; a
forward pre-hook on each block reads that block's inputs and advances the register stream through the
block with the block's own frozen weights. What "through the block" means is the family's business:
``sd3.py``, ``flux.py``, ``wan.py`` (each reads top to bottom, one block type at a time). Under RoPE
(FLUX, Wan) the registers take the identity rotation.

A head is ``r = MLP(LN(concat_l mean_m reg_l))`` over the chosen layers (default: the last block); a reward
may have several, one per preference signal (the authors train ``preference``, ``pickscore`` and
``imagereward`` heads on one register stream), read together by ``score_heads`` and the first of them by
``score``. Only the registers and the heads are parameters of this module; the transformer is held outside
the module tree, frozen, so ``parameters()`` / ``state_dict()`` are exactly the trainable reward.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from flowalign.errors import UserError
from flowalign.io import atomic_dir
from flowalign.protocols import Conditioning
from rewards.latent_registers import flux, sd3, wan
from rewards.latent_registers.base_model import load_frozen_transformer, resolve_base_model

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "registers.safetensors"
CLASS_PATH = "rewards.latent_registers:LatentRegisters"
#: 2: several named heads (``heads`` in config.json, weights ``heads.<name>.*``); 1: one head, ``head.*``
FORMAT_VERSION = 2
#: the name of a one-head reward's head (and of every head a format-1 folder has)
DEFAULT_HEAD = "reward"
#: transformer class name → the family that knows how registers pass its blocks
FAMILIES = {sd3.CLASS_NAME: sd3.SD3Registers, flux.CLASS_NAME: flux.FluxRegisters, wan.CLASS_NAME: wan.WanRegisters}


def family_options_for(transformer: nn.Module, policy: Any) -> dict[str, Any]:
    """The family options (``LatentRegisters(family_options=...)``) that make registers on ``transformer``
    score latents exactly as ``policy`` samples them (FLUX: its latent grid and guidance; others: none)."""
    kind = type(transformer).__name__
    if kind not in FAMILIES:
        raise UserError(f"latent registers support {', '.join(FAMILIES)}; got {kind}")
    return FAMILIES[kind].options_from_policy(policy)


def resolve_layers(layers: str | Sequence[int], num_layers: int) -> list[int]:
    """Block indices whose register states feed the head: ``"last"``, ``"multi"`` (L/2, 3L/4, L) or a list
    of 0-based indices (negative counts from the end)."""
    if layers == "last":
        return [num_layers - 1]
    if layers == "multi":
        return sorted({max(0, num_layers // 2 - 1), max(0, 3 * num_layers // 4 - 1), num_layers - 1})
    if isinstance(layers, str):
        raise UserError(f"layers={layers!r}: use 'last', 'multi' or a list of block indices")
    if not layers or any(not -num_layers <= int(i) < num_layers for i in layers):
        raise UserError(f"layers={list(layers)}: indices must lie in [-{num_layers}, {num_layers - 1}] (the DiT has {num_layers} blocks)")
    return sorted({int(i) % num_layers for i in layers})


class LatentRegisters(nn.Module):
    """A :class:`flowalign.protocols.LatentReward` ``score(x, σ, cond) -> (B,)`` on a frozen DiT.

    ``transformer``: a diffusers ``SD3Transformer2DModel``, ``FluxTransformer2DModel`` or
    ``WanTransformer3DModel`` (frozen here: its parameters stop requiring grad). ``x``: latents in that
    family's policy convention (SD3 ``(B, C, h, w)``, FLUX packed ``(B, seq, 4C)``, Wan ``(B, C, F, h, w)``);
    ``cond``: the same family's policy encoding. ``family_options``: FLUX's ``latent_hw`` and ``guidance``.
    ``heads``: the names of the reward's heads (one MLP each on the same register features); ``score`` reads
    the first.
    """

    def __init__(self, transformer: nn.Module, *, num_registers: int = 8, layers: str | Sequence[int] = "last",
                 head_hidden: int = 256, base_model: str | None = None, seed: int = 0,
                 family_options: dict[str, Any] | None = None, heads: Sequence[str] = (DEFAULT_HEAD,)):
        super().__init__()
        kind = type(transformer).__name__
        if kind not in FAMILIES:
            raise UserError(f"latent registers support {', '.join(FAMILIES)}; got {kind}")
        if num_registers < 1:
            raise UserError(f"num_registers={num_registers}: use at least 1 register")
        heads = [str(h) for h in heads]
        if not heads or len(set(heads)) != len(heads) or not all(h.isidentifier() for h in heads):
            raise UserError(f"heads={heads}: give one or more distinct names (letters, digits, _), e.g. vvr, vvr_soft")
        transformer.requires_grad_(False).eval()
        transformer.gradient_checkpointing = False  # a checkpointed block would re-run the hooks
        self.__dict__["transformer"] = transformer  # outside the module tree: not ours to train or save
        self.__dict__["family"] = FAMILIES[kind](transformer, family_options or {})
        dim = transformer.config.num_attention_heads * transformer.config.attention_head_dim
        self.layers = resolve_layers(layers, len(self.family.blocks()))
        self.base_model = base_model
        self.options = {"num_registers": num_registers, "layers": self.layers, "head_hidden": head_hidden,
                        "heads": heads, **{k: v for k, v in self.family.options().items() if v is not None}}
        gen = torch.Generator().manual_seed(seed)
        # distinct random registers: identical ones would receive identical updates forever
        self.registers = nn.Parameter(torch.randn(num_registers, dim, generator=gen))
        width = dim * len(self.layers)
        self.heads = nn.ModuleDict({h: nn.Sequential(nn.LayerNorm(width), nn.Linear(width, head_hidden), nn.SiLU(),
                                                     nn.Linear(head_hidden, 1)) for h in heads})
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)  # in order: the first head is initialised as a one-head reward's
            for head in self.heads.values():
                head.apply(lambda m: m.reset_parameters() if isinstance(m, nn.Linear) else None)
        self.to(next(transformer.parameters()).device)

    @property
    def head_names(self) -> list[str]:
        return list(self.heads)

    @property
    def head(self) -> nn.Module:
        """The first head, the one ``score`` reads."""
        return next(iter(self.heads.values()))

    # ------------------------------------------------------------------ scoring
    def forward_with_velocity(self, x: torch.Tensor, sigma: float | torch.Tensor, cond: Conditioning
                              ) -> tuple[torch.Tensor, torch.Tensor]:
        """One DiT pass: the frozen model's velocity (float32, no CFG, shaped like ``x``) and the first head's
        reward ``(B,)``."""
        velocity, features = self.features_with_velocity(x, sigma, cond)
        return velocity, self.head(features).squeeze(-1)

    def features_with_velocity(self, x: torch.Tensor, sigma: float | torch.Tensor, cond: Conditioning
                               ) -> tuple[torch.Tensor, torch.Tensor]:
        """One DiT pass: the frozen model's velocity and the register features the heads read ``(B, L·dim)``."""
        device, dtype = self.registers.device, next(self.transformer.parameters()).dtype
        b = x.shape[0]
        if len(cond) != b:
            raise ValueError(f"score: x has batch {b} but cond has {len(cond)} prompts")
        sigma = torch.as_tensor(sigma, dtype=torch.float32).to(device, non_blocking=True).flatten().expand(b)
        state = {"reg": self.registers.to(dtype).unsqueeze(0).expand(b, -1, -1), "feats": {}}

        def advance(index: int, block: nn.Module, args: tuple, kwargs: dict) -> None:
            state["reg"] = self.family.advance(block, state["reg"], args, kwargs)
            if index in self.layers:
                state["feats"][index] = state["reg"].float().mean(1)

        handles = [blk.register_forward_pre_hook(lambda m, a, k, i=i: advance(i, m, a, k), with_kwargs=True)
                   for i, blk in enumerate(self.family.blocks())]
        try:
            velocity = self.family.velocity(x, sigma, cond)
        finally:
            for h in handles:
                h.remove()
        return velocity, torch.cat([state["feats"][i] for i in self.layers], dim=-1)

    def score(self, x: torch.Tensor, sigma: float | torch.Tensor, cond: Conditioning) -> torch.Tensor:
        """``r_ψ(x_σ, σ, c)`` ``(B,)`` float32 of the first head, differentiable in ``x`` (and in the registers
        and head)."""
        return self.forward_with_velocity(x, sigma, cond)[1]

    def score_heads(self, x: torch.Tensor, sigma: float | torch.Tensor, cond: Conditioning) -> dict[str, torch.Tensor]:
        """Every head's ``r_h(x_σ, σ, c)`` ``(B,)`` from one DiT pass (the authors' ``score``: a dict by head)."""
        features = self.features_with_velocity(x, sigma, cond)[1]
        return {name: head(features).squeeze(-1) for name, head in self.heads.items()}

    def forward(self, x: torch.Tensor, sigma: float | torch.Tensor, cond: Conditioning) -> torch.Tensor:
        return self.score(x, sigma, cond)

    # ------------------------------------------------------------------ files
    def save(self, directory: str | Path, extra: dict[str, Any] | None = None, *, overwrite: bool = True) -> Path:
        """``config.json`` + ``registers.safetensors`` into ``directory``, swapped in atomically
        (:func:`flowalign.io.atomic_dir`: other files there are kept; ``overwrite=False`` refuses a
        non-empty folder that holds no earlier save)."""
        directory = Path(directory)
        with atomic_dir(directory, writer="latent-registers", overwrite=overwrite) as tmp:
            self.write_files(tmp, extra)
        return directory

    def write_files(self, folder: Path, extra: dict[str, Any] | None = None) -> None:
        """Write ``config.json`` and ``registers.safetensors`` into an existing ``folder`` (no atomicity)."""
        from safetensors.torch import save_file

        config = {"class": CLASS_PATH, "format_version": FORMAT_VERSION, "family": self.family.name,
                  "base_model": self.base_model, "dim": int(self.registers.shape[1]), **self.options, **(extra or {})}
        state = {k: v.detach().float().cpu().contiguous() for k, v in self.state_dict().items()}
        save_file(state, str(Path(folder) / WEIGHTS_NAME))
        (Path(folder) / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")

    @classmethod
    def load(cls, directory: str | Path, *, transformer: nn.Module | None = None, device: str | torch.device = "cpu",
             dtype: torch.dtype | None = None) -> "LatentRegisters":
        """Registers from :meth:`save`'s folder on ``transformer`` (default: the base model's own, loaded frozen)."""
        from safetensors.torch import load_file

        directory = Path(directory)
        config = read_config(directory)
        if config.get("architecture", "registers") != "registers":
            return architecture_class(config, directory).load(directory, transformer=transformer, device=device,
                                                              dtype=dtype)
        if transformer is None:
            transformer = load_frozen_transformer(config.get("base_model"), directory, device, dtype)
        family = FAMILIES.get(type(transformer).__name__)
        if family is not None and config.get("family", "sd3") != family.name:
            raise UserError(f"{directory}: registers trained on a {config.get('family')!r} transformer cannot read a "
                            f"{family.name!r} one; load them on the base model they were trained on")
        reward = cls(transformer, num_registers=int(config["num_registers"]), layers=config["layers"],
                     head_hidden=int(config["head_hidden"]), base_model=config.get("base_model"),
                     family_options={k: config[k] for k in ("latent_hw", "guidance") if k in config},
                     heads=config.get("heads", [DEFAULT_HEAD]))
        dim = reward.registers.shape[1]
        if int(config.get("dim", dim)) != dim:
            raise UserError(f"{directory}: registers of width {config['dim']} do not fit this transformer (width {dim}); "
                            "load them on the base model they were trained on")
        state = load_file(str(directory / WEIGHTS_NAME))
        if "heads" not in config:  # format 1: one head, saved as head.*
            state = {f"heads.{DEFAULT_HEAD}.{k[5:]}" if k.startswith("head.") else k: v for k, v in state.items()}
        reward.load_state_dict(state)
        return reward.to(next(transformer.parameters()).device)


    @classmethod
    def sizes(cls, directory: Path) -> dict[str, int]:
        """What :meth:`load` allocates, read from the folder's headers without loading: ``own`` trainable
        parameters (registers and heads) and ``model``: the one frozen base transformer it loads."""
        from safetensors import safe_open

        config = read_config(directory)
        if config.get("architecture", "registers") != "registers":
            return architecture_class(config, directory).sizes(directory)
        with safe_open(str(directory / WEIGHTS_NAME), "pt") as weights:
            own = sum(math.prod(weights.get_slice(k).get_shape()) for k in weights.keys())
        return {"own": int(own), "model": 1}


def architecture_class(config: dict[str, Any], directory: Path) -> type:
    """The class that reads a folder whose ``config.json`` names an ``architecture`` other than these registers
    (``grid_pool``: :class:`~rewards.latent_registers.grid.GridReward`, whose ``load`` builds the folder's family)."""
    from rewards.latent_registers import grid

    kind = config.get("architecture")
    if kind != grid.ARCHITECTURE:
        raise UserError(f"{directory / CONFIG_NAME}: architecture {kind!r} is unknown; use 'registers' (the default) "
                        f"or {grid.ARCHITECTURE!r}")
    return grid.GridReward


def read_config(directory: Path) -> dict[str, Any]:
    # register.safetensors: the authors' checkpoint file, read by an architecture: grid_pool config beside it
    weights = (directory / WEIGHTS_NAME).is_file() or (directory / "register.safetensors").is_file()
    if not (directory / CONFIG_NAME).is_file() or not weights:
        raise UserError(f"{directory} is not a latent reward folder (needs {CONFIG_NAME} and {WEIGHTS_NAME}); "
                        "write one with `flowalign train-reward`")
    try:
        return json.loads((directory / CONFIG_NAME).read_text())
    except json.JSONDecodeError as err:
        raise UserError(f"{directory / CONFIG_NAME} is not valid JSON ({err})") from err


@torch.no_grad()
def encode_images(policy: Any, images: torch.Tensor) -> torch.Tensor:
    """Pixels ``(B, 3, H, W)`` in [0, 1], any size → clean latents ``(B, C, h, w)`` float32 in the SD3 policy's
    convention: resized to the model's resolution, then the policy's own ``encode_images`` (VAE posterior
    mean, shift, scale; the inverse of its ``decode``)."""
    if getattr(policy, "family", None) != "sd3" or not hasattr(policy, "encode_images"):
        raise UserError("preference pairs from image files need an SD3 model (its VAE encodes them); "
                        f"got family {getattr(policy, 'family', '?')!r}")
    h, w = int(policy.defaults["height"]), int(policy.defaults["width"])
    if tuple(images.shape[-2:]) != (h, w):
        images = F.interpolate(images.float(), size=(h, w), mode="bilinear", antialias=True, align_corners=False)
    return policy.encode_images(images).cpu()
