"""Latent reward registers on FLUX.1 (``FluxTransformer2DModel``): double- and single-stream blocks.

Forward pre-hooks read each block's inputs ``(hidden_states, encoder_hidden_states, temb,
image_rotary_emb)`` and advance the registers with the block's frozen weights, as extra image tokens
that no image or text query can see. Registers take the identity rotation; the image and text keys
they attend to are rotated exactly as the block rotates them ([text; image] positions).

Double-stream block (image-stream weights for the registers [derived]):

    reg += gate_msa · to_out(attn(q_reg, rope([K_txt; K_img]) ++ K_reg, [V_txt; V_img] ++ V_reg))
    reg += gate_mlp · ff(norm2(reg)·(1+scale_mlp) + shift_mlp)

Single-stream block (one weight set; attention and MLP in parallel, no attention out-projection):

    n = norm(reg, temb)
    reg += gate · proj_out([attn(q_reg, rope(K_all) ++ K_reg, V_all ++ V_reg); act(proj_mlp(n))])

``x`` is FLUX's packed latent ``(B, (h/2)·(w/2), 4C)``; the image position ids need the token grid,
taken from the ``latent_hw`` option (the policy's ``latent_hw``) or, when absent, a square grid.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from flowalign.errors import UserError
from flowalign.protocols import Conditioning
from pipelines._common import grid_ids
from rewards.latent_registers.family import RegisterFamily, block_inputs

CLASS_NAME = "FluxTransformer2DModel"
BLOCK_INPUTS = ("hidden_states", "encoder_hidden_states", "temb", "image_rotary_emb")
COND_KEYS = ("prompt_embeds", "pooled_prompt_embeds")


def _tokens(attn: nn.Module, t: torch.Tensor) -> torch.Tensor:
    """``(B, N, H·d)`` → ``(B, N, H, d)`` (FLUX's processor layout)."""
    return t.unflatten(-1, (-1, attn.head_dim))


def _rope(t: torch.Tensor, rotary_emb: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    from diffusers.models.embeddings import apply_rotary_emb

    return t if rotary_emb is None else apply_rotary_emb(t, rotary_emb, sequence_dim=1)


def _register_attention(attn: nn.Module, n_reg: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Register queries ``(B, M, D)`` over ``[keys; register keys]`` (``(B, N, H, d)``, keys already rotated):
    the attention output ``(B, M, D)`` before any out-projection."""
    q = attn.norm_q(_tokens(attn, attn.to_q(n_reg)))
    k = torch.cat([keys, attn.norm_k(_tokens(attn, attn.to_k(n_reg)))], 1)
    v = torch.cat([values, _tokens(attn, attn.to_v(n_reg))], 1)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    return out.transpose(1, 2).flatten(2).to(q.dtype)


def double_keys_values(block: nn.Module, hidden: torch.Tensor, context: torch.Tensor, temb: torch.Tensor,
                       rotary_emb: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys (rotated) and values ``(B, L+N, H, d)`` over ``[text; image]`` that one ``FluxTransformerBlock``'s
    attention reads, from exactly its inputs."""
    attn = block.attn
    n_img = block.norm1(hidden, emb=temb)[0]
    n_txt = block.norm1_context(context, emb=temb)[0]
    k_txt = attn.norm_added_k(_tokens(attn, attn.add_k_proj(n_txt)))
    k_img = attn.norm_k(_tokens(attn, attn.to_k(n_img)))
    keys = _rope(torch.cat([k_txt, k_img], 1), rotary_emb)
    values = torch.cat([_tokens(attn, attn.add_v_proj(n_txt)), _tokens(attn, attn.to_v(n_img))], 1)
    return keys, values


def single_keys_values(block: nn.Module, hidden: torch.Tensor, context: torch.Tensor, temb: torch.Tensor,
                       rotary_emb: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys (rotated) and values ``(B, L+N, H, d)`` over ``[text; image]`` that one
    ``FluxSingleTransformerBlock``'s attention reads, from exactly its inputs."""
    attn = block.attn
    n_all = block.norm(torch.cat([context, hidden], 1), emb=temb)[0]
    return _rope(attn.norm_k(_tokens(attn, attn.to_k(n_all))), rotary_emb), _tokens(attn, attn.to_v(n_all))


def flux_double_register_block(block: nn.Module, reg: torch.Tensor, hidden: torch.Tensor, context: torch.Tensor,
                               temb: torch.Tensor, rotary_emb: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """Advance registers ``(B, M, D)`` through one ``FluxTransformerBlock`` given exactly its inputs."""
    attn = block.attn
    n_reg, gate_msa, shift_mlp, scale_mlp, gate_mlp = block.norm1(reg, emb=temb)
    keys, values = double_keys_values(block, hidden, context, temb, rotary_emb)
    reg = reg + gate_msa.unsqueeze(1) * attn.to_out[0](_register_attention(attn, n_reg, keys, values))
    normed = block.norm2(reg) * (1 + scale_mlp[:, None]) + shift_mlp[:, None]
    return reg + gate_mlp.unsqueeze(1) * block.ff(normed)


def flux_single_register_block(block: nn.Module, reg: torch.Tensor, hidden: torch.Tensor, context: torch.Tensor,
                               temb: torch.Tensor, rotary_emb: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """Advance registers ``(B, M, D)`` through one ``FluxSingleTransformerBlock`` given exactly its inputs."""
    attn = block.attn
    n_reg, gate = block.norm(reg, emb=temb)
    keys, values = single_keys_values(block, hidden, context, temb, rotary_emb)
    mixed = torch.cat([_register_attention(attn, n_reg, keys, values), block.act_mlp(block.proj_mlp(n_reg))], 2)
    return reg + gate.unsqueeze(1) * block.proj_out(mixed)


class FluxRegisters(RegisterFamily):
    """The FLUX family for :class:`~rewards.latent_registers.LatentRegisters`.

    Options: ``latent_hw`` (the unpacked latent's ``(h, w)``; default square from the token count) and
    ``guidance`` (the guidance-embedding value the reward scores at; default 3.5 for guidance-distilled
    checkpoints such as FLUX.1-dev, unused for schnell).
    """

    name = "flux"

    def __init__(self, transformer: nn.Module, options: dict[str, Any]):
        super().__init__(transformer, options)
        self.latent_hw = tuple(options["latent_hw"]) if options.get("latent_hw") else None
        self.guidance = float(options.get("guidance") or 3.5) if transformer.config.guidance_embeds else None
        self.double = set(map(id, transformer.transformer_blocks))

    @staticmethod
    def options_from_policy(policy: Any) -> dict[str, Any]:
        """What the reward must score at to match ``policy``: its latent grid and guidance value."""
        return {"latent_hw": list(policy.latent_hw), "guidance": policy.defaults.get("guidance_scale")}

    def options(self) -> dict[str, Any]:
        return {"latent_hw": list(self.latent_hw) if self.latent_hw else None, "guidance": self.guidance}

    def blocks(self) -> list[nn.Module]:
        return list(self.transformer.transformer_blocks) + list(self.transformer.single_transformer_blocks)

    def advance(self, block: nn.Module, reg: torch.Tensor, args: tuple, kwargs: dict) -> torch.Tensor:
        step = flux_double_register_block if id(block) in self.double else flux_single_register_block
        return step(block, reg, *block_inputs(BLOCK_INPUTS, args, kwargs))

    def token_grid(self, seq: int) -> tuple[int, int]:
        """The packed token grid ``(h/2, w/2)`` of ``seq`` image tokens (``latent_hw``, else square)."""
        if self.latent_hw:
            h2, w2 = self.latent_hw[0] // 2, self.latent_hw[1] // 2
            if h2 * w2 == seq:
                return h2, w2
            raise UserError(f"latent registers on FLUX: x has {seq} tokens but latent_hw={list(self.latent_hw)} "
                            f"gives {h2 * w2}; score latents of the resolution the reward was trained at")
        side = math.isqrt(seq)
        if side * side != seq:
            raise UserError(f"latent registers on FLUX: {seq} tokens is not a square grid; set the reward's "
                            "latent_hw option to the policy's latent_hw")
        return side, side

    def velocity(self, x: torch.Tensor, sigma: torch.Tensor, cond: Conditioning) -> torch.Tensor:
        """The frozen DiT's plain forward on packed ``x (B, seq, 4C)``; ``sigma (B,)``."""
        if any(k not in cond.tensors for k in COND_KEYS):
            raise UserError("latent registers on FLUX need FLUX conditioning (prompt_embeds, pooled_prompt_embeds): "
                            "encode the prompts with a FLUX policy")
        if x.ndim != 3:
            raise UserError(f"latent registers on FLUX score packed latents (B, seq, 4C); got shape {tuple(x.shape)}")
        tr = self.transformer
        dtype, device, b = next(tr.parameters()).dtype, sigma.device, x.shape[0]
        h2, w2 = self.token_grid(x.shape[1])
        embeds = cond.tensors["prompt_embeds"].to(device, dtype)
        guidance = None if self.guidance is None else torch.full((b,), self.guidance, device=device)
        # FLUX's transformer multiplies the timestep by 1000 itself
        return tr(hidden_states=x.to(device, dtype), timestep=sigma, guidance=guidance,
                  pooled_projections=cond.tensors["pooled_prompt_embeds"].to(device, dtype),
                  encoder_hidden_states=embeds, img_ids=grid_ids(self, h2, w2, device, dtype),
                  txt_ids=torch.zeros(embeds.shape[1], 3, device=device, dtype=dtype), return_dict=False)[0].float()
