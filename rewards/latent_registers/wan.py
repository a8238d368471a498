"""Latent reward registers on Wan 2.1 / 2.2 text-to-video (``WanTransformer3DModel``).

A forward pre-hook on each ``WanTransformerBlock`` reads its inputs ``(hidden_states,
encoder_hidden_states, temb, rotary_emb)`` and advances the registers with the block's frozen weights,
as if they were extra video tokens that no video query can see:

    shift, scale, gate, c_shift, c_scale, c_gate = scale_shift_table + temb
    n = norm1(h)·(1+scale) + shift                                    (video tokens and registers alike)
    reg += gate · attn1(q_reg, [rope(K_vid); K_reg], [V_vid; V_reg])  (registers: identity rotation)
    reg += attn2(norm2(reg), text)                                     (cross-attention, ungated as in Wan)
    reg += c_gate · ffn(norm3(reg)·(1+c_scale) + c_shift)

Wan's qk-norm spans all heads (RMSNorm before the head split), so q/k are normed, then split. Wan 2.2
TI2V passes a per-token ``temb (B, N, 6, D)``; for text-to-video every token shares σ, so the registers
take token 0's modulation. Image-to-video blocks (image keys in the cross-attention) are not supported.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from flowalign.errors import UserError
from flowalign.protocols import Conditioning
from rewards.latent_registers.family import RegisterFamily, block_inputs

CLASS_NAME = "WanTransformer3DModel"
BLOCK_INPUTS = ("hidden_states", "encoder_hidden_states", "temb", "rotary_emb")


def _split_heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    """``(B, N, H·d)`` → ``(B, H, N, d)``."""
    return t.unflatten(2, (heads, -1)).transpose(1, 2)


def _rotate(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Wan's interleaved RoPE on ``(B, N, H, d)`` (the attention processor's own formula)."""
    x1, x2 = t.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[..., 0::2], sin[..., 1::2]
    out = torch.empty_like(t)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(t)


def _attend(attn: nn.Module, reg: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Register queries ``(B, M, D)`` over ``[keys; register keys]`` (both ``(B, H, N, d)``), projected out."""
    q = _split_heads(attn.norm_q(attn.to_q(reg)), attn.heads)
    out = F.scaled_dot_product_attention(q, keys, values)
    return attn.to_out[0](out.transpose(1, 2).flatten(2).type_as(q))


def wan_register_block(block: nn.Module, reg: torch.Tensor, hidden: torch.Tensor, context: torch.Tensor,
                       temb: torch.Tensor, rotary_emb: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Advance registers ``(B, M, D)`` through one ``WanTransformerBlock`` given exactly its inputs:
    ``hidden (B, N, D)`` video tokens, ``context (B, L, D)`` projected text, ``temb (B, 6, D)`` (or
    ``(B, N, 6, D)``), ``rotary_emb`` (cos, sin) ``(1, N, 1, d)``."""
    if temb.ndim == 4:
        temb = temb[:, 0]
    shift, scale, gate, c_shift, c_scale, c_gate = (block.scale_shift_table + temb.float()).chunk(6, dim=1)

    attn = block.attn1
    n_vid = (block.norm1(hidden.float()) * (1 + scale) + shift).type_as(hidden)
    n_reg = (block.norm1(reg.float()) * (1 + scale) + shift).type_as(reg)
    k_vid = _rotate(attn.norm_k(attn.to_k(n_vid)).unflatten(2, (attn.heads, -1)), *rotary_emb).transpose(1, 2)
    v_vid = _split_heads(attn.to_v(n_vid), attn.heads)
    k_reg = _split_heads(attn.norm_k(attn.to_k(n_reg)), attn.heads)
    v_reg = _split_heads(attn.to_v(n_reg), attn.heads)
    out = _attend(attn, n_reg, torch.cat([k_vid, k_reg], 2), torch.cat([v_vid, v_reg], 2))
    reg = (reg.float() + out * gate).type_as(reg)

    cross = block.attn2
    n_reg = block.norm2(reg.float()).type_as(reg)
    k_txt = _split_heads(cross.norm_k(cross.to_k(context)), cross.heads)
    v_txt = _split_heads(cross.to_v(context), cross.heads)
    reg = reg + _attend(cross, n_reg, k_txt, v_txt)

    n_reg = (block.norm3(reg.float()) * (1 + c_scale) + c_shift).type_as(reg)
    return (reg.float() + block.ffn(n_reg).float() * c_gate).type_as(reg)


class WanRegisters(RegisterFamily):
    """The Wan family for :class:`~rewards.latent_registers.LatentRegisters`; ``x`` is ``(B, C, F', h, w)``."""

    name = "wan"

    def __init__(self, transformer: nn.Module, options: dict[str, Any]):
        if transformer.config.get("image_dim") or transformer.config.get("added_kv_proj_dim"):
            raise UserError("latent registers support Wan text-to-video transformers; this one is image-conditioned "
                            "(image_dim / added_kv_proj_dim set)")
        for blk in transformer.blocks:
            if getattr(blk.attn1, "fused_projections", False) or getattr(blk.attn2, "fused_projections", False):
                raise UserError("latent registers need unfused Wan attention projections: call "
                                "transformer.unfuse_qkv_projections() first")
        super().__init__(transformer, options)

    def blocks(self) -> list[nn.Module]:
        return list(self.transformer.blocks)

    def advance(self, block: nn.Module, reg: torch.Tensor, args: tuple, kwargs: dict) -> torch.Tensor:
        return wan_register_block(block, reg, *block_inputs(BLOCK_INPUTS, args, kwargs))

    def velocity(self, x: torch.Tensor, sigma: torch.Tensor, cond: Conditioning) -> torch.Tensor:
        """The frozen DiT's plain forward (no CFG) on ``x (B, C, F', h, w)``; ``sigma (B,)``."""
        if "prompt_embeds" not in cond.tensors:
            raise UserError("latent registers on Wan need Wan conditioning (prompt_embeds): encode the prompts "
                            "with a Wan policy")
        if x.ndim != 5:
            raise UserError(f"latent registers on Wan score video latents (B, C, F, h, w); got shape {tuple(x.shape)}")
        tr = self.transformer
        dtype, device = next(tr.parameters()).dtype, sigma.device
        # one σ per sample even for Wan 2.2 TI2V (whose pipeline expands it per token: same values, T2V)
        return tr(hidden_states=x.to(device, dtype), timestep=sigma * 1000.0,
                  encoder_hidden_states=cond.tensors["prompt_embeds"].to(device, dtype),
                  return_dict=False)[0].float()
