"""Latent reward registers in the authors' paper architecture on FLUX.1 (``architecture: grid_pool`` on a
``FluxTransformer2DModel``; theirs is ``flux_latent_reward_grid_pool_nope_multihead``). See
``docs/methods/latent_registers.md``; what every family shares (parameters, head, files, the authors' folders) is
:class:`~rewards.latent_registers.grid.GridReward`.

The layer indices count FLUX's double-stream blocks, then its single-stream blocks (their preset on FLUX.1-dev's
19 + 38: taps 9, 19, 28, the register stream stopping at block 28). Up to ``num_transformer_layers`` blocks:

1. **A register stream.** ``M`` position-free tokens ``reward_tokens``, without rotary embedding (their "NoPE":
   the identity rotation), while the image and text keys they read are rotated as the block rotates them. In a
   double-stream block the registers are modulated by the image stream's ``norm1``; in a single-stream block by
   its ``norm``. Queries come from their own trainable ``reward_q_proj`` (then the block's ``norm_q``), keys and
   values from the block's frozen ``to_k`` (+ ``norm_k``) / ``to_v``; they attend over ``[registers; text;
   image]`` in one softmax. Double-stream: ``reg += gate_msa · to_out(attention)``, no feed-forward.
   Single-stream: ``reg += gate · proj_out([attention; act(proj_mlp(n))])``, the block's parallel MLP included
   (it is fused with the attention through ``proj_out``). Image and text tokens never see the registers: the
   blocks run diffusers' own forward.
2. **Taps.** After blocks ``feature_layers`` the image tokens are average-pooled by ``pool_factor`` on their
   packed token grid (``latent_hw / 2``, the authors' fixed 64 × 64 at 1024 px) and the text tokens are kept.
3. **The head** (:mod:`~rewards.latent_registers.grid_head`) reads the taps with ``temb_proj(temb)``: FLUX's
   σ/guidance/pooled-text embedding through a trainable same-width linear (theirs), then ``score_mlps``.

``x`` is FLUX's packed latent ``(B, (h/2)·(w/2), 4C)`` (the policy's convention); σ enters as FLUX's own forward
takes it (``timestep = 1000 σ``), with the guidance embedding at ``guidance`` (default 3.5, their
``GUIDANCE_SCALE``) on guidance-distilled checkpoints.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from flowalign.errors import UserError
from flowalign.protocols import Conditioning
from pipelines._common import grid_ids
from rewards.latent_registers import flux
from rewards.latent_registers.grid import GridReward

#: the authors' name for this architecture (``register.architecture`` in their ``config.yaml``)
AUTHORS_ARCHITECTURE = "flux_latent_reward_grid_pool_nope_multihead"
#: the authors' FLUX preset (``configs/register/flux/paper.yaml``): taps at 1/6, 1/3, 1/2 of 57 blocks (19 double +
#: 38 single; tap 19 is the last double-stream block), two heads
PAPER = {"heads": ["preference", "imagereward"], "feature_layers": [9, 19, 28], "text_layers": [9, 19, 28],
         "num_transformer_layers": 28, "layer_index_base": 1, "num_reward_tokens": 32, "num_attn_heads": 8,
         "pool_factor": 4, "width": -1, "head_hidden_factor": 2, "skip_attn2": True, "use_self_attn": True,
         "use_proj_in": False}


def paper_options(num_layers: int) -> dict[str, Any]:
    """The preset scaled to a FLUX transformer of ``num_layers`` blocks (double + single): taps at 1/6, 1/3 and
    1/2 of its depth rounded down (1-based, as their 9/19/28 of 57), the register stream stopping at the deepest
    tap. FLUX.1-dev (57 blocks) gets exactly ``PAPER``."""
    if num_layers < 2:
        raise UserError(f"the grid_pool registers need a transformer of at least 2 blocks; this one has {num_layers}")
    taps = sorted({max(1, num_layers * k // 6) for k in (1, 2, 3)})
    return {**PAPER, "feature_layers": taps, "text_layers": taps, "num_transformer_layers": max(taps)}


# ---------------------------------------------------------------------------------------------- the trunk
def register_attention(attn: nn.Module, n_reg: torch.Tensor, q_proj: nn.Linear, keys: torch.Tensor,
                       values: torch.Tensor) -> torch.Tensor:
    """Modulated registers ``n_reg (B, M, D)`` attending over ``[registers; keys]`` (``keys``/``values``
    ``(B, L+N, H, d)``, already rotated; the registers unrotated): the output ``(B, M, D)`` before any
    out-projection. Queries by ``q_proj`` (trainable) and the block's ``norm_q``."""
    q = F.linear(n_reg, q_proj.weight.to(n_reg.dtype), q_proj.bias.to(n_reg.dtype))
    q = attn.norm_q(flux._tokens(attn, q))
    k = torch.cat([attn.norm_k(flux._tokens(attn, attn.to_k(n_reg))), keys], 1)
    v = torch.cat([flux._tokens(attn, attn.to_v(n_reg)), values], 1)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    return out.transpose(1, 2).flatten(2).to(q.dtype)


def double_register_step(block: nn.Module, reg: torch.Tensor, q_proj: nn.Linear, temb: torch.Tensor,
                         keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Registers ``(B, M, D)`` through one ``FluxTransformerBlock``'s attention (no feed-forward)."""
    n_reg, gate_msa = block.norm1(reg, emb=temb)[:2]
    return reg + gate_msa.unsqueeze(1) * block.attn.to_out[0](register_attention(block.attn, n_reg, q_proj, keys, values))


def single_register_step(block: nn.Module, reg: torch.Tensor, q_proj: nn.Linear, temb: torch.Tensor,
                         keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Registers ``(B, M, D)`` through one ``FluxSingleTransformerBlock``: attention and parallel MLP."""
    n_reg, gate = block.norm(reg, emb=temb)
    mixed = torch.cat([register_attention(block.attn, n_reg, q_proj, keys, values),
                       block.act_mlp(block.proj_mlp(n_reg))], 2)
    return reg + gate.unsqueeze(1) * block.proj_out(mixed)


class FluxGridRegisters(GridReward):
    """:class:`~rewards.latent_registers.grid.GridReward` on a frozen FLUX.1 transformer.

    ``family_options``: ``latent_hw`` (the unpacked latent's ``(h, w)``; default a square token grid) and
    ``guidance`` (the guidance-embedding value scored at; default 3.5, unused by checkpoints without one).
    """

    family = "flux"
    transformer_class = flux.CLASS_NAME
    authors_architecture = AUTHORS_ARCHITECTURE
    paper_options = staticmethod(paper_options)
    options_from_policy = staticmethod(flux.FluxRegisters.options_from_policy)

    @staticmethod
    def blocks_of(transformer: nn.Module) -> list[nn.Module]:
        return list(transformer.transformer_blocks) + list(transformer.single_transformer_blocks)

    def family_setup(self, transformer: nn.Module, options: dict[str, Any]) -> dict[str, Any]:
        # the FLUX register family's reading of latent_hw and guidance (and its token grid), shared
        self.inputs = flux.FluxRegisters(transformer, options)
        self.n_double = len(transformer.transformer_blocks)
        return {k: v for k, v in self.inputs.options().items() if v is not None}

    def extra_parameters(self, dim: int) -> None:
        # FLUX's temb is already the transformer's width: theirs bridges it to the head by a trainable linear
        self.temb_proj = nn.Linear(dim, dim)
        nn.init.xavier_uniform_(self.temb_proj.weight)
        nn.init.zeros_(self.temb_proj.bias)

    def features(self, x: torch.Tensor, sigma: float | torch.Tensor, cond: Conditioning) -> torch.Tensor:
        """Per-register head features ``(B, M, width)`` float32 of packed latents ``x (B, seq, 4C)`` at ``σ``
        (scalar or ``(B,)``), differentiable in ``x`` and in the reward's parameters."""
        if any(k not in cond.tensors for k in flux.COND_KEYS):
            raise UserError("grid_pool registers on FLUX need FLUX conditioning (prompt_embeds, pooled_prompt_embeds): "
                            "encode the prompts with a FLUX policy")
        if x.ndim != 3:
            raise UserError(f"grid_pool registers on FLUX score packed latents (B, seq, 4C); got shape {tuple(x.shape)}")
        tr = self.transformer
        b = x.shape[0]
        if len(cond) != b:
            raise ValueError(f"score: x has batch {b} but cond has {len(cond)} prompts")
        grid = self.inputs.token_grid(x.shape[1])
        self.check_token_grid(grid)
        dtype, device = next(tr.parameters()).dtype, self.reward_tokens.device
        sigma = torch.as_tensor(sigma, dtype=torch.float32).to(device).flatten().expand(b)
        embeds = cond.tensors["prompt_embeds"].to(device, dtype)
        pooled = cond.tensors["pooled_prompt_embeds"].to(device, dtype)
        hidden = tr.x_embedder(x.to(device, dtype))
        context = tr.context_embedder(embeds)
        # as FluxTransformer2DModel.forward: σ and the guidance scaled by 1000 in the transformer's dtype
        timestep = sigma.to(dtype) * 1000
        if self.inputs.guidance is None:
            temb = tr.time_text_embed(timestep, pooled)
        else:
            temb = tr.time_text_embed(timestep, torch.full_like(sigma, self.inputs.guidance).to(dtype) * 1000, pooled)
        ids = torch.cat([torch.zeros(embeds.shape[1], 3, device=device, dtype=dtype),
                         grid_ids(self.inputs, grid[0], grid[1], device, dtype)])
        rotary = tr.pos_embed(ids)
        reg = self.reward_tokens.to(dtype).unsqueeze(0).expand(b, -1, -1)
        image_taps: dict[int, torch.Tensor] = {}
        text_taps: dict[int, torch.Tensor] = {}
        for i, blk in enumerate(self.blocks_of(tr)[: self.stop]):
            double = i < self.n_double
            # the block's K,V from its own inputs; the block then runs diffusers' own forward (a second K/V
            # projection, cheap next to the block), so the generator's trunk is unchanged
            keys, values = (flux.double_keys_values if double else flux.single_keys_values)(
                blk, hidden, context, temb, rotary)
            context, hidden = blk(hidden_states=hidden, encoder_hidden_states=context, temb=temb,
                                  image_rotary_emb=rotary)
            step = double_register_step if double else single_register_step
            reg = step(blk, reg, self.reward_q_proj, temb, keys, values)
            if i in self.image_taps:
                image_taps[i] = hidden
            if i in self.text_taps:
                text_taps[i] = context
        return self.read_out(reg, image_taps, text_taps, grid, self.temb_proj(temb.to(self.reward_tokens.dtype)))
