"""The authors' paper register architecture (``architecture: grid_pool`` in the reward folder's ``config.json``;
theirs is ``latent_reward_grid_pool_nope_multihead`` on SD3, ``flux_latent_reward_grid_pool_nope_multihead`` on
FLUX, ``zimage_latent_reward_grid_pool_nope_multihead`` on Z-Image) for any DiT family: what every family shares. See ``docs/methods/latent_registers.md``.

:class:`GridReward` holds the options, the trainable parameters (``reward_tokens``, ``reward_q_proj``, the head
``reward_head`` of :mod:`~rewards.latent_registers.grid_head` and one ``score_mlps[k] = Linear(W, W/f) → GELU →
Linear(·, 1)`` per named head, the reward being the mean over registers), the files, and the authors' checkpoint
folders. A family subclass says how the register stream passes its blocks and where the taps are
(``features``): :class:`~rewards.latent_registers.sd3_grid.GridRegisters` (SD3),
:class:`~rewards.latent_registers.flux_grid.FluxGridRegisters` (FLUX) and
:class:`~rewards.latent_registers.zimage_grid.ZImageGridRegisters` (Z-Image). Parameter names are the authors', so their
model's state dict (less ``backbone.*``) loads unchanged (:func:`from_authors_state`).

:meth:`GridReward.load` reads a folder of any family, saved by :meth:`GridReward.save` or in the authors' layout
(``register.safetensors`` + ``config.yaml`` + ``manifest.json``), and builds the family's class: the folder's
``family`` (their manifest's ``backbone``), or the given transformer's class when the folder names none.
"""

from __future__ import annotations

import importlib
import json
import math
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

from flowalign.errors import UserError
from flowalign.io import atomic_dir
from flowalign.protocols import Conditioning
from rewards.latent_registers.base_model import load_frozen_transformer
from rewards.latent_registers.grid_head import GridHead, pool_tokens

ARCHITECTURE = "grid_pool"
#: their checkpoint folder's files
AUTHORS_FILES = ("register.safetensors", "config.yaml", "manifest.json")
CONFIG_NAME, WEIGHTS_NAME = "config.json", "registers.safetensors"
CLASS_PATH = "rewards.latent_registers:LatentRegisters"
FORMAT_VERSION = 2
#: family (the config's ``family``, their manifest's ``backbone``) → the class that runs it
FAMILY_CLASSES = {"sd3": "rewards.latent_registers.sd3_grid:GridRegisters",
                  "flux": "rewards.latent_registers.flux_grid:FluxGridRegisters",
                  "zimage": "rewards.latent_registers.zimage_grid:ZImageGridRegisters"}
#: their manifest's ``backbone`` spellings → family (their Z-Image config names its backbone ``z-image``)
BACKBONE_ALIASES = {"z-image": "zimage", "z_image": "zimage"}
#: the options only one family has (saved in config.json, given back as ``family_options``)
FAMILY_OPTION_KEYS = ("latent_hw", "guidance")


def family_class(family: str) -> type["GridReward"]:
    """The :class:`GridReward` subclass of ``family`` (``sd3``, ``flux``, ``zimage``)."""
    if family not in FAMILY_CLASSES:
        raise UserError(f"grid_pool registers exist for {', '.join(FAMILY_CLASSES)}; got family {family!r}")
    module, _, name = FAMILY_CLASSES[family].partition(":")
    return getattr(importlib.import_module(module), name)


def class_for(transformer: nn.Module) -> type["GridReward"]:
    """The :class:`GridReward` subclass that runs on ``transformer`` (by its diffusers class)."""
    kind = type(transformer).__name__
    for family in FAMILY_CLASSES:
        cls = family_class(family)
        if cls.transformer_class == kind:
            return cls
    names = ", ".join(family_class(f).transformer_class for f in FAMILY_CLASSES)
    raise UserError(f"grid_pool registers are built for {names}; got {kind}")


def grid_registers(transformer: nn.Module, policy: Any = None, **options: Any) -> "GridReward":
    """Registers of the authors' architecture on ``transformer``: its family's class with the authors' preset
    scaled to the transformer's depth, scoring latents as ``policy`` samples them (FLUX: its latent grid and
    guidance); ``options`` override the preset (``heads``, ``num_reward_tokens``, ``seed``, ``base_model``...)."""
    cls = class_for(transformer)
    preset = cls.paper_options(len(cls.blocks_of(transformer)))
    family_options = cls.options_from_policy(policy) if policy is not None else {}
    return cls(transformer, **{**preset, **options}, family_options=family_options)


class GridReward(nn.Module):
    """A :class:`flowalign.protocols.LatentReward` in the authors' architecture on a frozen DiT (a family subclass).

    ``feature_layers`` / ``text_layers``: 1-based (``layer_index_base``) indices of the blocks whose image / text
    outputs the head reads (FLUX: counted over the double- then the single-stream blocks); default: the family's
    preset scaled to the depth. ``num_transformer_layers``: blocks the register stream passes (default: to the
    deepest tap). ``width`` -1: the transformer's. ``family_options``: the family's own (FLUX: ``latent_hw``,
    ``guidance``). The transformer is held outside the module tree, so ``parameters()`` and ``state_dict()`` are
    the reward's.
    """

    #: ``family`` in config.json and ``backbone`` in the authors' manifest.json
    family = ""
    #: the diffusers class it runs on
    transformer_class = ""
    #: ``register.architecture`` in the authors' config.yaml
    authors_architecture = ""

    # ------------------------------------------------------------------ what a family says
    @staticmethod
    def blocks_of(transformer: nn.Module) -> list[nn.Module]:
        """The blocks the layer indices count, in order."""
        raise NotImplementedError

    @staticmethod
    def model_width(transformer: nn.Module) -> int:
        """The width ``D`` of the transformer's hidden states (the registers' width)."""
        return int(transformer.config.num_attention_heads * transformer.config.attention_head_dim)

    @staticmethod
    def paper_options(num_layers: int) -> dict[str, Any]:
        """The authors' preset for this family, scaled to ``num_layers`` blocks."""
        raise NotImplementedError

    @staticmethod
    def options_from_policy(policy: Any) -> dict[str, Any]:
        """The family options that score latents as ``policy`` samples them."""
        return {}

    def check_blocks(self, blocks: list[nn.Module]) -> None:
        """Refuse blocks (those the register stream passes) this architecture does not run."""

    def family_setup(self, transformer: nn.Module, options: dict[str, Any]) -> dict[str, Any]:
        """Take ``family_options``; returns those saved in the config."""
        return {}

    def extra_parameters(self, dim: int) -> None:
        """Create the family's own trainable modules (after ``reward_head``, before ``score_mlps``)."""

    def features(self, x: torch.Tensor, sigma: float | torch.Tensor, cond: Conditioning) -> torch.Tensor:
        """Per-register head features ``(B, M, width)`` float32 of latents ``x`` at ``σ``."""
        raise NotImplementedError

    def check_token_grid(self, grid: tuple[int, int]) -> None:
        """Refuse, in one line, a latent whose image token grid ``(h, w)`` the taps' pooling cannot cut."""
        if grid[0] % self.pool_factor or grid[1] % self.pool_factor:
            raise UserError(f"grid_pool registers: the latent's {grid[0]}x{grid[1]} token grid is not divisible by "
                            f"pool_factor {self.pool_factor}; use a resolution whose token grid is")

    def read_out(self, registers: torch.Tensor, image_taps: dict[int, torch.Tensor], text_taps: dict[int, torch.Tensor],
                 grid: tuple[int, int], temb: torch.Tensor) -> torch.Tensor:
        """The head's features ``(B, M, width)`` float32 from the register stream ``(B, M, D)``, each tapped
        layer's image tokens ``(B, h·w, D)`` (pooled here on their ``grid``) and text tokens ``(B, L, D)``, and
        the head's time embedding ``(B, D)``; all cast to the head's dtype."""
        head_dtype = self.reward_tokens.dtype
        images = [pool_tokens(image_taps[i], grid, self.pool_factor).to(head_dtype) for i in self.image_taps]
        texts = [text_taps[i].to(head_dtype) for i in self.text_taps]
        return self.reward_head(registers.to(head_dtype), images, texts, temb.to(head_dtype)).float()

    # ------------------------------------------------------------------ construction
    def __init__(self, transformer: nn.Module, *, heads: Sequence[str] | None = None,
                 feature_layers: Sequence[int] | None = None, text_layers: Sequence[int] | None = None,
                 num_transformer_layers: int | None = None, layer_index_base: int = 1,
                 num_reward_tokens: int = 32, num_attn_heads: int = 8, pool_factor: int = 4, width: int = -1,
                 head_hidden_factor: int = 2, skip_attn2: bool = True, use_self_attn: bool = True,
                 use_proj_in: bool = False, base_model: str | None = None, seed: int = 0,
                 family_options: dict[str, Any] | None = None):
        super().__init__()
        if type(transformer).__name__ != self.transformer_class:
            raise UserError(f"{type(self).__name__} registers are built for {self.transformer_class}; got "
                            f"{type(transformer).__name__}")
        if not use_self_attn:
            raise UserError("grid_pool registers implement the authors' joint first readout only: set use_self_attn true")
        blocks = self.blocks_of(transformer)
        preset = self.paper_options(len(blocks)) if heads is None or feature_layers is None else {}
        heads = [str(h) for h in (preset["heads"] if heads is None else heads)]
        if not heads or len(set(heads)) != len(heads) or not all(h.isidentifier() for h in heads):
            raise UserError(f"heads={heads}: give one or more distinct names (letters, digits, _)")
        feature_layers = list(preset["feature_layers"] if feature_layers is None else feature_layers)
        text_layers = list(feature_layers if text_layers is None else text_layers)
        image_taps = self._taps(feature_layers, layer_index_base, len(blocks), "feature_layers")
        text_taps = self._taps(text_layers, layer_index_base, len(blocks), "text_layers")
        stop = max(image_taps + text_taps) + 1
        if num_transformer_layers is not None:
            if not stop <= int(num_transformer_layers) <= len(blocks):
                raise UserError(f"num_transformer_layers={num_transformer_layers}: give {stop}..{len(blocks)} (it must "
                                "cover the deepest tap and fit the transformer)")
            stop = int(num_transformer_layers)
        self.check_blocks(blocks[:stop])
        dim = self.model_width(transformer)
        width = dim if width == -1 else int(width)
        if width % 4 or width % num_attn_heads:
            raise UserError(f"width={width}: must be divisible by 4 and by num_attn_heads={num_attn_heads}")
        transformer.requires_grad_(False).eval()
        self.__dict__["transformer"] = transformer  # outside the module tree: not ours to train or save
        self.image_taps, self.text_taps, self.stop = image_taps, text_taps, stop
        self.pool_factor = int(pool_factor)
        self.base_model = base_model
        self.options = {"architecture": ARCHITECTURE, "heads": heads, "feature_layers": [int(i) for i in feature_layers],
                        "text_layers": [int(i) for i in text_layers], "num_transformer_layers": stop,
                        "layer_index_base": int(layer_index_base), "num_reward_tokens": int(num_reward_tokens),
                        "num_attn_heads": int(num_attn_heads), "pool_factor": self.pool_factor, "width": width,
                        "head_hidden_factor": int(head_hidden_factor), "skip_attn2": bool(skip_attn2),
                        "use_self_attn": True, "use_proj_in": bool(use_proj_in),
                        **self.family_setup(transformer, dict(family_options or {}))}
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.reward_tokens = nn.Parameter(torch.randn(num_reward_tokens, dim) * 0.02)
            self.reward_q_proj = nn.Linear(dim, dim)
            nn.init.xavier_uniform_(self.reward_q_proj.weight)
            nn.init.zeros_(self.reward_q_proj.bias)
            self.reward_head = GridHead(dim, width, len(image_taps), len(text_taps), num_attn_heads,
                                        bool(skip_attn2), bool(use_proj_in))
            self.extra_parameters(dim)
            hidden = max(1, width // int(head_hidden_factor))
            self.score_mlps = nn.ModuleList(nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, 1))
                                            for _ in heads)
        self._heads = heads
        self.to(next(transformer.parameters()).device)

    @staticmethod
    def _taps(layers: Sequence[int], base: int, n: int, field: str) -> list[int]:
        taps = [int(i) - int(base) for i in layers]
        if not taps or any(not 0 <= t < n for t in taps):
            raise UserError(f"{field}={list(layers)} (layer_index_base {base}): give block indices in "
                            f"[{base}, {n - 1 + base}] for this {n}-block transformer")
        return list(dict.fromkeys(taps))

    @property
    def head_names(self) -> list[str]:
        return list(self._heads)

    # ------------------------------------------------------------------ scoring
    def score_heads(self, x: torch.Tensor, sigma: float | torch.Tensor, cond: Conditioning) -> dict[str, torch.Tensor]:
        """Every head's ``r_h(x_σ, σ, c)`` ``(B,)`` float32 from one pass: its MLP on each register, averaged."""
        feats = self.features(x, sigma, cond)
        return {name: mlp(feats).mean(dim=1).squeeze(-1).float() for name, mlp in zip(self._heads, self.score_mlps)}

    def score(self, x: torch.Tensor, sigma: float | torch.Tensor, cond: Conditioning) -> torch.Tensor:
        """The first head's reward ``(B,)``."""
        return self.score_heads(x, sigma, cond)[self._heads[0]]

    def forward(self, x: torch.Tensor, sigma: float | torch.Tensor, cond: Conditioning) -> torch.Tensor:
        return self.score(x, sigma, cond)

    # ------------------------------------------------------------------ files
    def save(self, directory: str | Path, extra: dict[str, Any] | None = None, *, overwrite: bool = True) -> Path:
        """``config.json`` + ``registers.safetensors`` (the authors' parameter names) into ``directory``, atomically."""
        directory = Path(directory)
        with atomic_dir(directory, writer="latent-registers", overwrite=overwrite) as tmp:
            self.write_files(tmp, extra)
        return directory

    def write_files(self, folder: Path, extra: dict[str, Any] | None = None) -> None:
        from safetensors.torch import save_file

        config = {"class": CLASS_PATH, "format_version": FORMAT_VERSION, "family": self.family,
                  "base_model": self.base_model, "dim": int(self.reward_tokens.shape[1]), **self.options, **(extra or {})}
        save_file({k: v.detach().float().cpu().contiguous() for k, v in self.state_dict().items()},
                  str(Path(folder) / WEIGHTS_NAME))
        (Path(folder) / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")

    @classmethod
    def from_config(cls, transformer: nn.Module, config: dict[str, Any]) -> "GridReward":
        keys = ("heads", "feature_layers", "text_layers", "num_transformer_layers", "layer_index_base",
                "num_reward_tokens", "num_attn_heads", "pool_factor", "width", "head_hidden_factor", "skip_attn2",
                "use_self_attn", "use_proj_in")
        return cls(transformer, base_model=config.get("base_model"), **{k: config[k] for k in keys if k in config},
                   family_options={k: config[k] for k in FAMILY_OPTION_KEYS if config.get(k) is not None})

    @classmethod
    def load(cls, directory: str | Path, *, transformer: nn.Module | None = None, base_model: str | None = None,
             device: str | torch.device = "cpu", dtype: torch.dtype | None = None) -> "GridReward":
        """Registers from :meth:`save`'s folder, or from the authors' checkpoint folder (then ``base_model``, a
        local diffusers folder of their backbone, or ``base_model`` in a ``config.json`` beside their files, names
        the frozen transformer; nothing is downloaded), as the folder's family's class."""
        from safetensors.torch import load_file

        directory = Path(directory)
        authors = is_authors_folder(directory)
        config = authors_config(directory) if authors else json.loads((directory / CONFIG_NAME).read_text())
        family = config.get("family")
        if transformer is not None:
            given = class_for(transformer).family
            if family and family != given:
                raise UserError(f"{directory}: grid_pool registers of a {family!r} transformer cannot read a {given!r} "
                                f"one ({type(transformer).__name__}); load them on the model they were trained on")
            family = given
        target = family_class(family or "sd3")  # grid_pool folders written before FLUX existed are SD3's
        base_model = base_model or config.get("base_model")
        if transformer is None:
            if authors and not base_model:
                raise UserError(f"{directory} is an authors' register checkpoint: give the local diffusers folder of "
                                f"their {target.family} model (load(..., base_model=PATH), or \"base_model\" in a "
                                "config.json beside its files)")
            transformer = load_frozen_transformer(base_model, directory, device, dtype)
            if type(transformer).__name__ != target.transformer_class:
                raise UserError(f"{directory}: registers of a {target.transformer_class} cannot read base_model "
                                f"{base_model!r}, a {type(transformer).__name__}; give the model they were trained on")
        dim = target.model_width(transformer)
        if int(config.get("dim", dim)) != dim:
            raise UserError(f"{directory}: registers of width {config['dim']} do not fit this transformer (width {dim}); "
                            "load them on the model they were trained on (base_model)")
        reward = target.from_config(transformer, {**config, "base_model": base_model})
        if authors:
            state = from_authors_state(load_file(str(directory / "register.safetensors")), transformer, directory)
        else:
            state = load_file(str(directory / WEIGHTS_NAME))
        missing, unexpected = reward.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise UserError(f"{directory}: weights do not match the configured architecture (missing {missing[:3]}, "
                            f"unexpected {unexpected[:3]}); the config's layers/heads must be the ones it was trained with")
        return reward.to(next(transformer.parameters()).device)

    @classmethod
    def sizes(cls, directory: Path) -> dict[str, int]:
        from safetensors import safe_open

        name = "register.safetensors" if is_authors_folder(directory) else WEIGHTS_NAME
        with safe_open(str(directory / name), "pt") as weights:
            own = sum(math.prod(weights.get_slice(k).get_shape()) for k in weights.keys()
                      if not _authors_key(k).startswith("backbone."))
        return {"own": int(own), "model": 1}


# ---------------------------------------------------------------------------------------------- authors' folders
def is_authors_folder(directory: Path) -> bool:
    """Their checkpoint layout: ``manifest.json`` and ``config.yaml`` (our own folders have neither)."""
    return (directory / "manifest.json").is_file() or (directory / "config.yaml").is_file()


def _authors_key(name: str) -> str:
    # their register.safetensors is the state dict of a wrapper holding the model as ``model``
    return name[len("model."):] if name.startswith("model.") else name


def authors_config(directory: Path) -> dict[str, Any]:
    """Our config (:class:`GridReward` keyword names and ``family``) from their ``manifest.json`` + ``config.yaml``,
    checked."""
    import yaml

    for name in AUTHORS_FILES:
        if not (directory / name).is_file():
            raise UserError(f"{directory} lacks {name}: an authors' register checkpoint holds {', '.join(AUTHORS_FILES)}")
    manifest = json.loads((directory / "manifest.json").read_text())
    settings = yaml.safe_load((directory / "config.yaml").read_text()) or {}
    register = settings.get("register") or {}
    ours = json.loads((directory / CONFIG_NAME).read_text()) if (directory / CONFIG_NAME).is_file() else {}
    backbone = str(manifest.get("backbone", "")).lower()
    backbone = BACKBONE_ALIASES.get(backbone, backbone)
    if backbone not in FAMILY_CLASSES:
        raise UserError(f"{directory / 'manifest.json'}: backbone {manifest.get('backbone')!r}; only their "
                        f"{', '.join(FAMILY_CLASSES)} registers (backbone: {', '.join(FAMILY_CLASSES)}) load here")
    expected = family_class(backbone).authors_architecture
    arch = register.get("architecture", expected)
    if arch != expected:
        raise UserError(f"{directory / 'config.yaml'}: register.architecture {arch!r}; with backbone {backbone!r} only "
                        f"{expected!r} is implemented (grid_pool)")
    heads = list(register.get("head_names") or manifest.get("head_names") or [])
    if list(manifest.get("head_names", heads)) != heads:
        raise UserError(f"{directory}: head order differs between manifest.json head_names {manifest.get('head_names')} "
                        f"and config.yaml register.head_names {heads}; the weights follow config.yaml, fix the manifest")
    feature_layers = list(register.get("feature_layers") or manifest.get("feature_layers") or [])
    config = {"family": backbone, "heads": heads, "feature_layers": feature_layers,
              "text_layers": list(register.get("text_layers") or feature_layers),
              "num_transformer_layers": register.get("num_transformer_layers"),
              "base_model": ours.get("base_model")}
    # their loader's defaults for fields a config leaves out
    for key, default in (("layer_index_base", 1), ("num_reward_tokens", 32), ("num_attn_heads", 8), ("pool_factor", 4),
                         ("width", -1), ("head_hidden_factor", 2), ("skip_attn2", True), ("use_self_attn", True),
                         ("use_proj_in", False)):
        config[key] = register.get(key, default)
    if backbone == "flux":
        # their FLUX model pools a fixed vis_h × vis_w packed token grid (64 × 64: 1024 px) and embeds the
        # guidance their backbone was built with (3.5 unless the config says otherwise)
        guidance = (settings.get("backbone") or {}).get("embedded_guidance_scale",
                                                        (settings.get("model") or {}).get("guidance_scale", 3.5))
        config.update(latent_hw=[2 * int(register.get("vis_h", 64)), 2 * int(register.get("vis_w", 64))],
                      guidance=float(guidance))
    return config


def from_authors_state(state: dict[str, torch.Tensor], transformer: nn.Module | None = None,
                       where: Path | str = "the state dict") -> dict[str, torch.Tensor]:
    """Their model's state dict (optionally under ``model.``) → ours: the same names less the frozen
    ``backbone.transformer.*`` it also carries, whose shapes are checked against ``transformer`` when given."""
    ours, backbone = {}, {}
    for name, value in state.items():
        key = _authors_key(name)
        (backbone if key.startswith("backbone.") else ours)[key] = value
    if transformer is not None and backbone:
        mine = transformer.state_dict()
        for key, value in backbone.items():
            sub = key[len("backbone.transformer."):]
            if sub in mine and tuple(mine[sub].shape) != tuple(value.shape):
                raise UserError(f"{where}: its backbone {sub} is {tuple(value.shape)} but the given transformer's is "
                                f"{tuple(mine[sub].shape)}; give the model the register was trained on (base_model)")
    return ours
