"""Latent Reward Registers: a reward read from noisy latents through a frozen DiT (``specs/latent_rewards.md``).

M learnable register tokens ride along a FROZEN SD3 transformer as a read-only path: register queries
attend to every token of each block, image and text queries never see a register. The generator is
therefore untouched (its velocity is bit-identical with and without the registers), and the reward costs
one DiT forward plus a thin stream of M tokens.

Implementation (the spec's "cheap equivalent"): the transformer runs its own, unmodified ``forward``;
a forward pre-hook on each joint block reads that block's inputs ``(hidden_states,
encoder_hidden_states, temb)`` and advances the register stream through the block with the block's own
frozen weights:

    K,V_img = to_k/to_v(norm1(h_img, temb))        K,V_txt = add_k/add_v(norm1_context(h_txt, temb))
    q, K,V_reg = to_q/to_k/to_v(norm1(reg, temb))                 (image-stream weights [derived])
    reg += gate_msa · to_out(attn(q, [K_img; K_txt; K_reg], [V_img; V_txt; V_reg]))
    reg += gate_msa2 · to_out(attn2(q2, [K2_img; K2_reg], ...))     (SD3.5 dual-attention blocks)
    reg += gate_mlp · ff(norm2(reg)·(1+scale_mlp) + shift_mlp)

Registers carry no positional embedding (SD3 adds position at patch embedding only). The head is
``r = MLP(LN(concat_l mean_m reg_l))`` over the chosen layers (default: the last block). Only the
registers and the head are parameters of this module; the transformer is held outside the module tree,
frozen, so ``parameters()`` / ``state_dict()`` are exactly the trainable reward.

FLUX and Wan: the same path applies (their single-stream blocks use one weight set; under RoPE the
registers take the identity rotation) but is not implemented yet; loading one raises a UserError.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from flowalign.errors import UserError
from flowalign.io import atomic_dir
from flowalign.paths import REPO_ROOT
from flowalign.protocols import Conditioning

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "registers.safetensors"
CLASS_PATH = "rewards.latent_registers:LatentRegisters"
FORMAT_VERSION = 1


def _heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    """``(B, N, H·d)`` → ``(B, H, N, d)``."""
    b, n, _ = t.shape
    return t.view(b, n, heads, -1).transpose(1, 2)


def _keys_values(attn: nn.Module, h: torch.Tensor, context: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """K (normed as the joint processor norms it) and V of already-modulated tokens ``h``, in heads layout."""
    if context:
        k, v, norm = attn.add_k_proj(h), attn.add_v_proj(h), attn.norm_added_k
    else:
        k, v, norm = attn.to_k(h), attn.to_v(h), attn.norm_k
    k, v = _heads(k, attn.heads), _heads(v, attn.heads)
    return (norm(k) if norm is not None else k), v


def _register_attention(attn: nn.Module, reg: torch.Tensor, others: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Register queries over ``[others...; registers]`` keys/values, projected out: ``(B, M, D)``."""
    q = _heads(attn.to_q(reg), attn.heads)
    if attn.norm_q is not None:
        q = attn.norm_q(q)
    k_reg, v_reg = _keys_values(attn, reg, context=False)
    keys = torch.cat([k for k, _ in others] + [k_reg], dim=2)
    values = torch.cat([v for _, v in others] + [v_reg], dim=2)
    out = F.scaled_dot_product_attention(q, keys, values)
    out = out.transpose(1, 2).reshape(reg.shape[0], reg.shape[1], -1).to(q.dtype)
    return attn.to_out[0](out)


def sd3_register_block(block: nn.Module, reg: torch.Tensor, hidden: torch.Tensor, context: torch.Tensor,
                       temb: torch.Tensor) -> torch.Tensor:
    """Advance registers ``(B, M, D)`` through one SD3 ``JointTransformerBlock`` given its inputs.

    ``hidden (B, N, D)``, ``context (B, L, D)``, ``temb (B, D)`` are exactly what the block received, so
    the register keys see the same K,V the block's own image and text queries saw.
    """
    dual = block.use_dual_attention
    if dual:
        n_reg, gate_msa, shift_mlp, scale_mlp, gate_mlp, n_reg2, gate_msa2 = block.norm1(reg, emb=temb)
        n_img, *_rest = block.norm1(hidden, emb=temb)
        n_img2 = _rest[4]
    else:
        n_reg, gate_msa, shift_mlp, scale_mlp, gate_mlp = block.norm1(reg, emb=temb)
        n_img = block.norm1(hidden, emb=temb)[0]
    if block.context_pre_only:
        n_txt = block.norm1_context(context, temb)
    else:
        n_txt = block.norm1_context(context, emb=temb)[0]
    others = [_keys_values(block.attn, n_img, context=False), _keys_values(block.attn, n_txt, context=True)]
    reg = reg + gate_msa.unsqueeze(1) * _register_attention(block.attn, n_reg, others)
    if dual:
        others2 = [_keys_values(block.attn2, n_img2, context=False)]
        reg = reg + gate_msa2.unsqueeze(1) * _register_attention(block.attn2, n_reg2, others2)
    normed = block.norm2(reg) * (1 + scale_mlp[:, None]) + shift_mlp[:, None]
    return reg + gate_mlp.unsqueeze(1) * block.ff(normed)


def _block_inputs(args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(hidden_states, encoder_hidden_states, temb)`` however the block was called."""
    names = ("hidden_states", "encoder_hidden_states", "temb")
    bound = dict(zip(names, args))
    bound.update({k: kwargs[k] for k in names if k in kwargs})
    return bound["hidden_states"], bound["encoder_hidden_states"], bound["temb"]


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
    """A :class:`flowalign.protocols.LatentReward` ``score(x, σ, cond) -> (B,)`` on a frozen SD3 DiT.

    ``transformer``: a diffusers ``SD3Transformer2DModel`` (frozen here: its parameters stop requiring
    grad). ``cond.tensors`` must hold ``prompt_embeds (B, L, J)`` and ``pooled_prompt_embeds (B, P)`` as
    the SD3 policy encodes them. ``x``: latents ``(B, C, h, w)`` in the policy's convention.
    """

    def __init__(self, transformer: nn.Module, *, num_registers: int = 8, layers: str | Sequence[int] = "last",
                 head_hidden: int = 256, base_model: str | None = None, seed: int = 0):
        super().__init__()
        family = type(transformer).__name__
        if family != "SD3Transformer2DModel":
            raise UserError(
                f"latent registers support SD3 transformers (SD3Transformer2DModel); got {family}. FLUX and Wan "
                "(same read-only path, identity RoPE on the registers) are not implemented yet")
        if num_registers < 1:
            raise UserError(f"num_registers={num_registers}: use at least 1 register")
        transformer.requires_grad_(False).eval()
        transformer.gradient_checkpointing = False  # a checkpointed block would re-run the hooks
        self.__dict__["transformer"] = transformer  # outside the module tree: not ours to train or save
        dim = transformer.config.num_attention_heads * transformer.config.attention_head_dim
        self.layers = resolve_layers(layers, transformer.config.num_layers)
        self.base_model = base_model
        self.options = {"num_registers": num_registers, "layers": self.layers, "head_hidden": head_hidden}
        gen = torch.Generator().manual_seed(seed)
        # distinct random registers: identical ones would receive identical updates forever
        self.registers = nn.Parameter(torch.randn(num_registers, dim, generator=gen))
        width = dim * len(self.layers)
        self.head = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, head_hidden), nn.SiLU(), nn.Linear(head_hidden, 1))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.head.apply(lambda m: m.reset_parameters() if isinstance(m, nn.Linear) else None)
        self.to(next(transformer.parameters()).device)

    # ------------------------------------------------------------------ scoring
    def forward_with_velocity(self, x: torch.Tensor, sigma: float | torch.Tensor, cond: Conditioning
                              ) -> tuple[torch.Tensor, torch.Tensor]:
        """One DiT pass: the frozen model's velocity ``(B, C, h, w)`` (float32, no CFG) and the reward ``(B,)``."""
        tr = self.transformer
        device, dtype = self.registers.device, next(tr.parameters()).dtype
        b = x.shape[0]
        if "prompt_embeds" not in cond.tensors or "pooled_prompt_embeds" not in cond.tensors:
            raise UserError("latent registers need SD3 conditioning (prompt_embeds, pooled_prompt_embeds): "
                            "encode the prompts with an SD3 policy")
        if len(cond) != b:
            raise ValueError(f"score: x has batch {b} but cond has {len(cond)} prompts")
        timestep = torch.as_tensor(sigma, dtype=torch.float32, device=device).flatten().expand(b) * 1000.0
        state = {"reg": self.registers.to(dtype).unsqueeze(0).expand(b, -1, -1), "feats": {}}

        def advance(index: int, block: nn.Module, args: tuple, kwargs: dict) -> None:
            hidden, context, temb = _block_inputs(args, kwargs)
            state["reg"] = sd3_register_block(block, state["reg"], hidden, context, temb)
            if index in self.layers:
                state["feats"][index] = state["reg"].float().mean(1)

        handles = [blk.register_forward_pre_hook(lambda m, a, k, i=i: advance(i, m, a, k), with_kwargs=True)
                   for i, blk in enumerate(tr.transformer_blocks)]
        try:
            velocity = tr(hidden_states=x.to(device, dtype), timestep=timestep,
                          encoder_hidden_states=cond.tensors["prompt_embeds"].to(device, dtype),
                          pooled_projections=cond.tensors["pooled_prompt_embeds"].to(device, dtype),
                          return_dict=False)[0].float()
        finally:
            for h in handles:
                h.remove()
        feats = torch.cat([state["feats"][i] for i in self.layers], dim=-1)
        return velocity, self.head(feats).squeeze(-1)

    def score(self, x: torch.Tensor, sigma: float | torch.Tensor, cond: Conditioning) -> torch.Tensor:
        """``r_ψ(x_σ, σ, c)`` ``(B,)`` float32, differentiable in ``x`` (and in the registers and head)."""
        return self.forward_with_velocity(x, sigma, cond)[1]

    def forward(self, x: torch.Tensor, sigma: float | torch.Tensor, cond: Conditioning) -> torch.Tensor:
        return self.score(x, sigma, cond)

    # ------------------------------------------------------------------ files
    def save(self, directory: str | Path, extra: dict[str, Any] | None = None) -> Path:
        """``config.json`` + ``registers.safetensors`` into ``directory`` (replaced in one rename)."""
        from safetensors.torch import save_file

        directory = Path(directory)
        config = {"class": CLASS_PATH, "format_version": FORMAT_VERSION, "family": "sd3",
                  "base_model": self.base_model, "dim": int(self.registers.shape[1]), **self.options, **(extra or {})}
        with atomic_dir(directory) as tmp:
            state = {k: v.detach().float().cpu().contiguous() for k, v in self.state_dict().items()}
            save_file(state, str(tmp / WEIGHTS_NAME))
            (tmp / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
        return directory

    @classmethod
    def load(cls, directory: str | Path, *, transformer: nn.Module | None = None, device: str | torch.device = "cpu",
             dtype: torch.dtype | None = None) -> "LatentRegisters":
        """Registers from :meth:`save`'s folder on ``transformer`` (default: the base model's own, loaded frozen)."""
        from safetensors.torch import load_file

        directory = Path(directory)
        config = read_config(directory)
        if transformer is None:
            transformer = load_frozen_transformer(config.get("base_model"), directory, device, dtype)
        reward = cls(transformer, num_registers=int(config["num_registers"]), layers=config["layers"],
                     head_hidden=int(config["head_hidden"]), base_model=config.get("base_model"))
        dim = reward.registers.shape[1]
        if int(config.get("dim", dim)) != dim:
            raise UserError(f"{directory}: registers of width {config['dim']} do not fit this transformer (width {dim}); "
                            "load them on the base model they were trained on")
        reward.load_state_dict(load_file(str(directory / WEIGHTS_NAME)))
        return reward.to(next(transformer.parameters()).device)


def read_config(directory: Path) -> dict[str, Any]:
    if not (directory / CONFIG_NAME).is_file() or not (directory / WEIGHTS_NAME).is_file():
        raise UserError(f"{directory} is not a latent reward folder (needs {CONFIG_NAME} and {WEIGHTS_NAME}); "
                        "write one with `flowalign train-reward`")
    try:
        return json.loads((directory / CONFIG_NAME).read_text())
    except json.JSONDecodeError as err:
        raise UserError(f"{directory / CONFIG_NAME} is not valid JSON ({err})") from err


def resolve_base_model(path: str | None, directory: Path) -> Path:
    if not path:
        raise UserError(f"{directory / CONFIG_NAME} names no base_model; pass the transformer to load() explicitly")
    p = Path(path)
    if not p.exists() and not p.is_absolute() and (REPO_ROOT / p).exists():
        p = REPO_ROOT / p
    if not (p / "transformer").is_dir():
        raise UserError(f"base_model {path!r} of {directory} has no transformer/ folder; fix base_model in "
                        f"{directory / CONFIG_NAME} to the diffusers folder the registers were trained on")
    return p


def load_frozen_transformer(path: str | None, directory: Path, device: str | torch.device = "cpu",
                            dtype: torch.dtype | None = None) -> nn.Module:
    """The base model's transformer alone, frozen: the reward's own copy, so a policy that trains its
    transformer (LoRA or full) never moves the reward."""
    from diffusers import SD3Transformer2DModel

    folder = resolve_base_model(path, directory)
    model = SD3Transformer2DModel.from_pretrained(str(folder), subfolder="transformer", torch_dtype=dtype or torch.float32)
    return model.to(device).requires_grad_(False).eval()


@torch.no_grad()
def encode_images(policy: Any, images: torch.Tensor) -> torch.Tensor:
    """Pixels ``(B, 3, H, W)`` in [0, 1] → clean latents ``(B, C, H/f, W/f)`` float32 in the SD3 policy's
    convention (the inverse of its ``decode``: VAE posterior mean, shift, scale)."""
    vae = getattr(policy, "vae", None)
    if vae is None or getattr(policy, "family", None) != "sd3":
        raise UserError("preference pairs from image files need an SD3 model (its VAE encodes them); "
                        f"got family {getattr(policy, 'family', '?')!r}")
    h, w = int(policy.defaults["height"]), int(policy.defaults["width"])
    if tuple(images.shape[-2:]) != (h, w):
        images = F.interpolate(images.float(), size=(h, w), mode="bilinear", antialias=True, align_corners=False)
    z = vae.encode((images.to(policy.device, vae.dtype) * 2 - 1)).latent_dist.mean
    shift = vae.config.shift_factor or 0.0
    return ((z.float() - shift) * vae.config.scaling_factor).cpu()
