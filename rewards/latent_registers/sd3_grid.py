"""Latent reward registers in the authors' paper architecture on SD3 (``architecture: grid_pool`` in the reward
folder's ``config.json``; theirs is named ``latent_reward_grid_pool_nope_multihead``). See
``docs/methods/latent_registers.md``.

Unlike :class:`~rewards.latent_registers.LatentRegisters` (registers through every block, head = MLP of the
mean register), this reward reads three things from the frozen ``SD3Transformer2DModel``, run only up to
``num_transformer_layers`` blocks (half its depth in the authors' preset):

1. **A register stream.** ``M`` position-free tokens ``reward_tokens``. In each block the registers are
   modulated by the block's ``norm1`` (σ and pooled text), projected to queries by their OWN trainable
   ``reward_q_proj`` and to keys/values by the block's frozen image-stream ``to_k``/``to_v``; they attend over
   ``[registers; image; text]`` keys of that block (image/text keys from the block's inputs, as the block itself
   sees them) and are updated by ``reg += gate_msa · to_out(attention)``: no feed-forward. Image and text tokens
   never see the registers, so the generator's hidden states are the diffusers block's own.
2. **Taps.** After blocks ``feature_layers`` (1-based) the image tokens are average-pooled by
   ``pool_factor`` on their token grid (``(h/p, w/p)``, read from the latent) and the text tokens are kept.
3. **A head** (``reward_head``). Per tap, a timestep FiLM adapter ``proj((x·(1+γ(temb)) + β(temb)) + e_l)`` to
   ``width/4``; the taps are concatenated and mixed (``agg_visual``, ``agg_text``) to ``width``. The registers,
   projected to ``width`` (``query_proj``), attend once over ``[registers; pooled image; text]`` in one softmax
   (``attn1``; RMS-normed inputs, residual), optionally a second time over the image alone (``attn2``, skipped
   in the preset), then pass a residual feed-forward (``norm_ff``, ``ff``). Each named head
   ``score_mlps[k] = Linear(width, width/head_hidden_factor) → GELU → Linear(·, 1)`` reads every register and
   the reward is the mean over registers.

Parameter names are the authors' own, so their model's state dict (less ``backbone.*``) loads unchanged
(:func:`from_authors_state`); :meth:`GridRegisters.load` also reads their checkpoint folder
(``register.safetensors`` + ``config.yaml`` + ``manifest.json``) on a local SD3 folder given by the user.
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
from rewards.latent_registers import sd3

ARCHITECTURE = "grid_pool"
#: the authors' name for this architecture (``register.architecture`` in their ``config.yaml``)
AUTHORS_ARCHITECTURE = "latent_reward_grid_pool_nope_multihead"
#: their checkpoint folder's files
AUTHORS_FILES = ("register.safetensors", "config.yaml", "manifest.json")
CONFIG_NAME, WEIGHTS_NAME = "config.json", "registers.safetensors"
CLASS_PATH = "rewards.latent_registers:LatentRegisters"
FORMAT_VERSION = 2
#: the authors' SD3 preset (``configs/register/sd3/paper.yaml``): taps at 1/6, 1/3, 1/2 of 24 blocks
PAPER = {"heads": ["preference", "pickscore", "imagereward"], "feature_layers": [4, 8, 12], "text_layers": [4, 8, 12],
         "num_transformer_layers": 12, "layer_index_base": 1, "num_reward_tokens": 32, "num_attn_heads": 8,
         "pool_factor": 4, "width": -1, "head_hidden_factor": 2, "skip_attn2": True, "use_self_attn": True,
         "use_proj_in": False}


def paper_options(num_layers: int) -> dict[str, Any]:
    """The preset scaled to a transformer of ``num_layers`` blocks: taps at 1/6, 1/3 and 1/2 of its depth
    (1-based), the register stream stopping at half depth. SD3-Medium (24 blocks) gets exactly ``PAPER``."""
    if num_layers < 2:
        raise UserError(f"the grid_pool registers need a transformer of at least 2 blocks; this one has {num_layers}")
    taps = sorted({max(1, round(num_layers * f)) for f in (1 / 6, 1 / 3, 1 / 2)})
    return {**PAPER, "feature_layers": taps, "text_layers": taps, "num_transformer_layers": max(taps)}


def rms(dim: int) -> nn.RMSNorm:
    return nn.RMSNorm(dim)  # eps=None: the dtype's own epsilon, as theirs


def split_heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    """``(B, N, H·d)`` → ``(B, H, N, d)``."""
    return t.view(t.shape[0], t.shape[1], heads, -1).transpose(1, 2)


def merge_heads(t: torch.Tensor) -> torch.Tensor:
    """``(B, H, N, d)`` → ``(B, N, H·d)``."""
    return t.transpose(1, 2).reshape(t.shape[0], t.shape[2], -1)


def pool_tokens(tokens: torch.Tensor, grid: tuple[int, int], factor: int) -> torch.Tensor:
    """Average-pool image tokens ``(B, h·w, C)`` (row-major ``grid = (h, w)``) by ``factor`` → ``(B, h·w/factor², C)``."""
    h, w = grid
    b, n, c = tokens.shape
    x = tokens.transpose(1, 2).reshape(b, c, h, w)
    return F.avg_pool2d(x, factor).flatten(2).transpose(1, 2)


# ---------------------------------------------------------------------------------------------- the head
class FiLMTap(nn.Module):
    """One tap's adapter: ``(B, N, D)`` tokens and ``temb (B, D)`` → ``(B, N, width/4)``."""

    def __init__(self, dim: int, width: int, use_proj_in: bool):
        super().__init__()
        self.proj_in = nn.Linear(dim, width) if use_proj_in or dim != width else nn.Identity()
        self.layer_embed = nn.Parameter(torch.randn(1, 1, width) * 0.02)
        self.cond_mlp = nn.Sequential(nn.Linear(dim, 2 * width), nn.SiLU(), nn.Linear(2 * width, 2 * width))
        self.proj = nn.Linear(width, width // 4)
        nn.init.zeros_(self.cond_mlp[-1].weight)  # starts as the identity modulation
        nn.init.zeros_(self.cond_mlp[-1].bias)

    def forward(self, tokens: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        gamma, beta = self.cond_mlp(temb).chunk(2, dim=-1)
        x = self.proj_in(tokens) * (1 + gamma[:, None]) + beta[:, None]
        return self.proj(x + self.layer_embed)


class JointReadout(nn.Module):
    """``attn1``: register queries over ``[registers; image; text]`` in one softmax, plus the residual."""

    def __init__(self, width: int, heads: int, use_text: bool):
        super().__init__()
        self.heads = heads
        self.norm_q, self.norm_v = rms(width), rms(width)
        self.norm_t = rms(width) if use_text else None
        self.to_q = nn.Linear(width, width)
        self.to_k_reward, self.to_v_reward = nn.Linear(width, width), nn.Linear(width, width)
        self.to_k_vis, self.to_v_vis = nn.Linear(width, width), nn.Linear(width, width)
        self.to_k_text = nn.Linear(width, width) if use_text else None
        self.to_v_text = nn.Linear(width, width) if use_text else None
        self.to_out = nn.Sequential(nn.Linear(width, width), nn.Dropout(0.0))

    def forward(self, q: torch.Tensor, image: torch.Tensor, text: torch.Tensor | None) -> torch.Tensor:
        """``q (B, M, W)``, ``image (B, N', W)``, ``text (B, L, W)`` → ``(B, M, W)``."""
        qn, im = self.norm_q(q), self.norm_v(image)
        keys, values = [self.to_k_reward(qn), self.to_k_vis(im)], [self.to_v_reward(qn), self.to_v_vis(im)]
        if self.norm_t is not None and text is not None:
            tx = self.norm_t(text)
            keys.append(self.to_k_text(tx))
            values.append(self.to_v_text(tx))
        out = F.scaled_dot_product_attention(split_heads(self.to_q(qn), self.heads),
                                             split_heads(torch.cat(keys, 1), self.heads),
                                             split_heads(torch.cat(values, 1), self.heads))
        return q + self.to_out(merge_heads(out))


class ImageReadout(nn.Module):
    """``attn2``: register queries over the pooled image alone, plus the residual."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm_q, self.norm_v = rms(width), rms(width)
        self.to_q, self.to_k_vis, self.to_v_vis = nn.Linear(width, width), nn.Linear(width, width), nn.Linear(width, width)
        self.to_out = nn.Sequential(nn.Linear(width, width), nn.Dropout(0.0))

    def forward(self, q: torch.Tensor, image: torch.Tensor) -> torch.Tensor:
        im = self.norm_v(image)
        out = F.scaled_dot_product_attention(split_heads(self.to_q(self.norm_q(q)), self.heads),
                                             split_heads(self.to_k_vis(im), self.heads),
                                             split_heads(self.to_v_vis(im), self.heads))
        return q + self.to_out(merge_heads(out))


class GridHead(nn.Module):
    """``reward_head``: taps and registers → per-register features ``(B, M, width)``."""

    def __init__(self, dim: int, width: int, n_image: int, n_text: int, heads: int, skip_attn2: bool,
                 use_proj_in: bool):
        super().__init__()
        self.skip_attn2 = skip_attn2
        self.layer_adapters_visual = nn.ModuleList(FiLMTap(dim, width, use_proj_in) for _ in range(n_image))
        self.layer_adapters_text = nn.ModuleList(FiLMTap(dim, width, use_proj_in) for _ in range(n_text))
        self.agg_visual = nn.Linear(n_image * (width // 4), width)
        self.agg_text = nn.Linear(n_text * (width // 4), width) if n_text else None
        self.query_proj = nn.Linear(dim, width)
        self.attn1 = JointReadout(width, heads, use_text=n_text > 0)
        # held even when skipped, so a state dict of either setting loads into the other
        self.attn2 = ImageReadout(width, heads)
        self.norm_ff = rms(width)
        self.ff = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width), nn.Dropout(0.0))

    def forward(self, registers: torch.Tensor, image_taps: list[torch.Tensor], text_taps: list[torch.Tensor],
                temb: torch.Tensor) -> torch.Tensor:
        image = self.agg_visual(torch.cat([a(t, temb) for a, t in zip(self.layer_adapters_visual, image_taps)], -1))
        text = None
        if self.agg_text is not None:
            text = self.agg_text(torch.cat([a(t, temb) for a, t in zip(self.layer_adapters_text, text_taps)], -1))
        q = self.attn1(self.query_proj(registers), image, text)
        if not self.skip_attn2:
            q = self.attn2(q, image)
        return q + self.ff(self.norm_ff(q))


# ---------------------------------------------------------------------------------------------- the trunk
def register_step(block: nn.Module, reg: torch.Tensor, q_proj: nn.Linear, temb: torch.Tensor,
                  others: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Registers ``(B, M, D)`` through one joint block's attention: queries by ``q_proj`` (trainable), keys and
    values by the block's image-stream weights; ``others`` are the block's image and text ``(K, V)``."""
    attn = block.attn
    n_reg, gate_msa = block.norm1(reg, emb=temb)[:2]
    q = split_heads(F.linear(n_reg, q_proj.weight.to(n_reg.dtype), q_proj.bias.to(n_reg.dtype)), attn.heads)
    if attn.norm_q is not None:
        q = attn.norm_q(q)
    k_reg, v_reg = sd3._keys_values(attn, n_reg, context=False)
    keys = torch.cat([k_reg] + [k for k, _ in others], dim=2)
    values = torch.cat([v_reg] + [v for _, v in others], dim=2)
    out = attn.to_out[0](merge_heads(F.scaled_dot_product_attention(q, keys, values)))
    return reg + gate_msa[:, None] * out


class GridRegisters(nn.Module):
    """A :class:`flowalign.protocols.LatentReward` in the authors' architecture on a frozen SD3 transformer.

    ``feature_layers`` / ``text_layers``: 1-based (``layer_index_base``) block indices whose outputs the head
    reads; ``num_transformer_layers``: blocks run (default: the deepest tap). ``width`` -1: the transformer's.
    The transformer is held outside the module tree, so ``parameters()`` and ``state_dict()`` are the reward's.
    """

    def __init__(self, transformer: nn.Module, *, heads: Sequence[str] = PAPER["heads"],
                 feature_layers: Sequence[int] = PAPER["feature_layers"], text_layers: Sequence[int] | None = None,
                 num_transformer_layers: int | None = None, layer_index_base: int = 1,
                 num_reward_tokens: int = 32, num_attn_heads: int = 8, pool_factor: int = 4, width: int = -1,
                 head_hidden_factor: int = 2, skip_attn2: bool = True, use_self_attn: bool = True,
                 use_proj_in: bool = False, base_model: str | None = None, seed: int = 0):
        super().__init__()
        if type(transformer).__name__ != sd3.CLASS_NAME:
            raise UserError(f"grid_pool registers are built for SD3 ({sd3.CLASS_NAME}); got {type(transformer).__name__}")
        if not use_self_attn:
            raise UserError("grid_pool registers implement the authors' joint first readout only: set use_self_attn true")
        heads = [str(h) for h in heads]
        if not heads or len(set(heads)) != len(heads) or not all(h.isidentifier() for h in heads):
            raise UserError(f"heads={heads}: give one or more distinct names (letters, digits, _)")
        blocks = list(transformer.transformer_blocks)
        image_taps = self._taps(feature_layers, layer_index_base, len(blocks), "feature_layers")
        text_taps = self._taps(text_layers if text_layers is not None else feature_layers, layer_index_base,
                               len(blocks), "text_layers")
        stop = max(image_taps + text_taps) + 1
        if num_transformer_layers is not None:
            if not stop <= int(num_transformer_layers) <= len(blocks):
                raise UserError(f"num_transformer_layers={num_transformer_layers}: give {stop}..{len(blocks)} (it must "
                                "cover the deepest tap and fit the transformer)")
            stop = int(num_transformer_layers)
        for i, blk in enumerate(blocks[:stop]):
            if blk.use_dual_attention or blk.context_pre_only:
                raise UserError(f"grid_pool registers run plain SD3 joint blocks; block {i} is "
                                f"{'an SD3.5 dual-attention' if blk.use_dual_attention else 'the final context-only'} block")
        dim = transformer.config.num_attention_heads * transformer.config.attention_head_dim
        width = dim if width == -1 else int(width)
        if width % 4 or width % num_attn_heads:
            raise UserError(f"width={width}: must be divisible by 4 and by num_attn_heads={num_attn_heads}")
        transformer.requires_grad_(False).eval()
        self.__dict__["transformer"] = transformer  # outside the module tree: not ours to train or save
        self.image_taps, self.text_taps, self.stop = image_taps, text_taps, stop
        self.pool_factor = int(pool_factor)
        self.base_model = base_model
        self.options = {"architecture": ARCHITECTURE, "heads": heads, "feature_layers": [int(i) for i in feature_layers],
                        "text_layers": [int(i) for i in (text_layers if text_layers is not None else feature_layers)],
                        "num_transformer_layers": stop, "layer_index_base": int(layer_index_base),
                        "num_reward_tokens": int(num_reward_tokens), "num_attn_heads": int(num_attn_heads),
                        "pool_factor": self.pool_factor, "width": width, "head_hidden_factor": int(head_hidden_factor),
                        "skip_attn2": bool(skip_attn2), "use_self_attn": True, "use_proj_in": bool(use_proj_in)}
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.reward_tokens = nn.Parameter(torch.randn(num_reward_tokens, dim) * 0.02)
            self.reward_q_proj = nn.Linear(dim, dim)
            nn.init.xavier_uniform_(self.reward_q_proj.weight)
            nn.init.zeros_(self.reward_q_proj.bias)
            self.reward_head = GridHead(dim, width, len(image_taps), len(text_taps), num_attn_heads,
                                        bool(skip_attn2), bool(use_proj_in))
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
    def features(self, x: torch.Tensor, sigma: float | torch.Tensor, cond: Conditioning) -> torch.Tensor:
        """Per-register head features ``(B, M, width)`` float32 of latents ``x (B, C, h, w)`` at ``σ`` (scalar or
        ``(B,)``), differentiable in ``x`` and in the reward's parameters."""
        if any(k not in cond.tensors for k in sd3.COND_KEYS):
            raise UserError("grid_pool registers need SD3 conditioning (prompt_embeds, pooled_prompt_embeds): "
                            "encode the prompts with an SD3 policy")
        tr = self.transformer
        b = x.shape[0]
        if len(cond) != b:
            raise ValueError(f"score: x has batch {b} but cond has {len(cond)} prompts")
        p = tr.config.patch_size
        grid = (x.shape[-2] // p, x.shape[-1] // p)
        if grid[0] % self.pool_factor or grid[1] % self.pool_factor:
            raise UserError(f"grid_pool registers: the latent's {grid[0]}x{grid[1]} token grid is not divisible by "
                            f"pool_factor {self.pool_factor}; use a resolution whose token grid is")
        dtype, device = next(tr.parameters()).dtype, self.reward_tokens.device
        sigma = torch.as_tensor(sigma, dtype=torch.float32).to(device).flatten().expand(b)
        hidden = tr.pos_embed(x.to(device, dtype))
        temb = tr.time_text_embed(sigma * 1000.0, cond.tensors["pooled_prompt_embeds"].to(device, dtype))
        context = tr.context_embedder(cond.tensors["prompt_embeds"].to(device, dtype))
        reg = self.reward_tokens.to(dtype).unsqueeze(0).expand(b, -1, -1)
        image_taps: dict[int, torch.Tensor] = {}
        text_taps: dict[int, torch.Tensor] = {}
        for i, blk in enumerate(tr.transformer_blocks[: self.stop]):
            # the block's image and text K,V from its own inputs; the block itself then runs its own forward
            # (a second norm1/K/V projection, cheap next to the block) so the trunk is diffusers' code unchanged
            others = [sd3._keys_values(blk.attn, blk.norm1(hidden, emb=temb)[0], context=False),
                      sd3._keys_values(blk.attn, blk.norm1_context(context, emb=temb)[0], context=True)]
            context, hidden = blk(hidden_states=hidden, encoder_hidden_states=context, temb=temb)
            reg = register_step(blk, reg, self.reward_q_proj, temb, others)
            if i in self.image_taps:
                image_taps[i] = hidden
            if i in self.text_taps:
                text_taps[i] = context
        head_dtype = self.reward_tokens.dtype
        images = [pool_tokens(image_taps[i], grid, self.pool_factor).to(head_dtype) for i in self.image_taps]
        texts = [text_taps[i].to(head_dtype) for i in self.text_taps]
        return self.reward_head(reg.to(head_dtype), images, texts, temb.to(head_dtype)).float()

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

        config = {"class": CLASS_PATH, "format_version": FORMAT_VERSION, "family": "sd3", "base_model": self.base_model,
                  "dim": int(self.reward_tokens.shape[1]), **self.options, **(extra or {})}
        save_file({k: v.detach().float().cpu().contiguous() for k, v in self.state_dict().items()},
                  str(Path(folder) / WEIGHTS_NAME))
        (Path(folder) / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")

    @classmethod
    def from_config(cls, transformer: nn.Module, config: dict[str, Any]) -> "GridRegisters":
        keys = ("heads", "feature_layers", "text_layers", "num_transformer_layers", "layer_index_base",
                "num_reward_tokens", "num_attn_heads", "pool_factor", "width", "head_hidden_factor", "skip_attn2",
                "use_self_attn", "use_proj_in")
        return cls(transformer, base_model=config.get("base_model"), **{k: config[k] for k in keys if k in config})

    @classmethod
    def load(cls, directory: str | Path, *, transformer: nn.Module | None = None, base_model: str | None = None,
             device: str | torch.device = "cpu", dtype: torch.dtype | None = None) -> "GridRegisters":
        """Registers from :meth:`save`'s folder, or from the authors' checkpoint folder (then ``base_model``, a
        local diffusers SD3 folder, or ``base_model`` in a ``config.json`` beside their files, names the frozen
        transformer; nothing is downloaded)."""
        from safetensors.torch import load_file

        from rewards.latent_registers.registers import load_frozen_transformer

        directory = Path(directory)
        authors = is_authors_folder(directory)
        config = authors_config(directory) if authors else json.loads((directory / CONFIG_NAME).read_text())
        base_model = base_model or config.get("base_model")
        if transformer is None:
            if authors and not base_model:
                raise UserError(f"{directory} is an authors' register checkpoint: give the local SD3 diffusers folder "
                                "(load(..., base_model=PATH), or \"base_model\" in a config.json beside its files)")
            transformer = load_frozen_transformer(base_model, directory, device, dtype)
        dim = transformer.config.num_attention_heads * transformer.config.attention_head_dim
        if int(config.get("dim", dim)) != dim:
            raise UserError(f"{directory}: registers of width {config['dim']} do not fit this transformer (width {dim}); "
                            "load them on the SD3 model they were trained on (base_model)")
        reward = cls.from_config(transformer, {**config, "base_model": base_model})
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
    """Our config (``GridRegisters`` keyword names) from their ``manifest.json`` + ``config.yaml``, checked."""
    import yaml

    for name in AUTHORS_FILES:
        if not (directory / name).is_file():
            raise UserError(f"{directory} lacks {name}: an authors' register checkpoint holds {', '.join(AUTHORS_FILES)}")
    manifest = json.loads((directory / "manifest.json").read_text())
    register = (yaml.safe_load((directory / "config.yaml").read_text()) or {}).get("register") or {}
    ours = json.loads((directory / CONFIG_NAME).read_text()) if (directory / CONFIG_NAME).is_file() else {}
    if str(manifest.get("backbone", "")).lower() != "sd3":
        raise UserError(f"{directory / 'manifest.json'}: backbone {manifest.get('backbone')!r}; only their SD3 registers "
                        "(backbone: sd3) load here")
    arch = register.get("architecture", AUTHORS_ARCHITECTURE)
    if arch != AUTHORS_ARCHITECTURE:
        raise UserError(f"{directory / 'config.yaml'}: register.architecture {arch!r}; only {AUTHORS_ARCHITECTURE!r} "
                        "is implemented (grid_pool)")
    heads = list(register.get("head_names") or manifest.get("head_names") or [])
    if list(manifest.get("head_names", heads)) != heads:
        raise UserError(f"{directory}: head order differs between manifest.json head_names {manifest.get('head_names')} "
                        f"and config.yaml register.head_names {heads}; the weights follow config.yaml, fix the manifest")
    feature_layers = list(register.get("feature_layers") or manifest.get("feature_layers") or [])
    config = {"heads": heads, "feature_layers": feature_layers,
              "text_layers": list(register.get("text_layers") or feature_layers),
              "num_transformer_layers": register.get("num_transformer_layers"),
              "base_model": ours.get("base_model")}
    # their loader's defaults for fields a config leaves out
    for key, default in (("layer_index_base", 1), ("num_reward_tokens", 32), ("num_attn_heads", 8), ("pool_factor", 4),
                         ("width", -1), ("head_hidden_factor", 2), ("skip_attn2", True), ("use_self_attn", True),
                         ("use_proj_in", False)):
        config[key] = register.get(key, default)
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
                                f"{tuple(mine[sub].shape)}; give the SD3 model the register was trained on (base_model)")
    return ours
