"""Latent reward registers on SD3 / SD3.5 (``SD3Transformer2DModel``): the register stream through a joint block.

A forward pre-hook on each ``JointTransformerBlock`` reads its inputs ``(hidden_states,
encoder_hidden_states, temb)`` and advances the registers with the block's own frozen weights:

    K,V_img = to_k/to_v(norm1(h_img, temb))        K,V_txt = add_k/add_v(norm1_context(h_txt, temb))
    q, K,V_reg = to_q/to_k/to_v(norm1(reg, temb))                 (image-stream weights [derived])
    reg += gate_msa · to_out(attn(q, [K_img; K_txt; K_reg], [V_img; V_txt; V_reg]))
    reg += gate_msa2 · to_out(attn2(q2, [K2_img; K2_reg], ...))     (SD3.5 dual-attention blocks)
    reg += gate_mlp · ff(norm2(reg)·(1+scale_mlp) + shift_mlp)

SD3 adds position at patch embedding only, so the registers carry no positional term at all.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from flowalign.errors import UserError
from flowalign.protocols import Conditioning
from rewards.latent_registers.family import RegisterFamily, block_inputs

CLASS_NAME = "SD3Transformer2DModel"
BLOCK_INPUTS = ("hidden_states", "encoder_hidden_states", "temb")
COND_KEYS = ("prompt_embeds", "pooled_prompt_embeds")


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


class SD3Registers(RegisterFamily):
    """The SD3 family for :class:`~rewards.latent_registers.LatentRegisters`."""

    name = "sd3"

    def blocks(self) -> list[nn.Module]:
        return list(self.transformer.transformer_blocks)

    def advance(self, block: nn.Module, reg: torch.Tensor, args: tuple, kwargs: dict) -> torch.Tensor:
        return sd3_register_block(block, reg, *block_inputs(BLOCK_INPUTS, args, kwargs))

    def velocity(self, x: torch.Tensor, sigma: torch.Tensor, cond: Conditioning) -> torch.Tensor:
        """The frozen DiT's plain forward (no CFG) on ``x (B, C, h, w)``; ``sigma (B,)``."""
        if any(k not in cond.tensors for k in COND_KEYS):
            raise UserError("latent registers on SD3 need SD3 conditioning (prompt_embeds, pooled_prompt_embeds): "
                            "encode the prompts with an SD3 policy")
        tr = self.transformer
        dtype, device = next(tr.parameters()).dtype, sigma.device
        return tr(hidden_states=x.to(device, dtype), timestep=sigma * 1000.0,
                  encoder_hidden_states=cond.tensors["prompt_embeds"].to(device, dtype),
                  pooled_projections=cond.tensors["pooled_prompt_embeds"].to(device, dtype),
                  return_dict=False)[0].float()
