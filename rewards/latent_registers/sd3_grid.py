"""Latent reward registers in the authors' paper architecture on SD3 (``architecture: grid_pool`` in the reward
folder's ``config.json``; theirs is named ``latent_reward_grid_pool_nope_multihead``). See
``docs/methods/latent_registers.md``; what every family shares (parameters, head, files, the authors' folders) is
:class:`~rewards.latent_registers.grid.GridReward`.

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
3. **The head** (:mod:`~rewards.latent_registers.grid_head`) reads the taps with the σ embedding ``temb`` and
   the registers; each named head ``score_mlps[k]`` reads every register and the reward is the mean over registers.

:meth:`GridRegisters.load` also reads their checkpoint folder (``register.safetensors`` + ``config.yaml`` +
``manifest.json``) on a local SD3 folder given by the user.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from flowalign.errors import UserError
from flowalign.protocols import Conditioning
from rewards.latent_registers import sd3
from rewards.latent_registers.grid import ARCHITECTURE, GridReward, from_authors_state  # noqa: F401 (their names, kept here)
from rewards.latent_registers.grid_head import merge_heads, split_heads

#: the authors' name for this architecture (``register.architecture`` in their ``config.yaml``)
AUTHORS_ARCHITECTURE = "latent_reward_grid_pool_nope_multihead"
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


class GridRegisters(GridReward):
    """:class:`~rewards.latent_registers.grid.GridReward` on a frozen SD3 transformer (``x``: latents
    ``(B, C, h, w)``, ``cond``: SD3 prompt encodings)."""

    family = "sd3"
    transformer_class = sd3.CLASS_NAME
    authors_architecture = AUTHORS_ARCHITECTURE
    paper_options = staticmethod(paper_options)

    @staticmethod
    def blocks_of(transformer: nn.Module) -> list[nn.Module]:
        return list(transformer.transformer_blocks)

    def check_blocks(self, blocks: list[nn.Module]) -> None:
        for i, blk in enumerate(blocks):
            if blk.use_dual_attention or blk.context_pre_only:
                raise UserError(f"grid_pool registers run plain SD3 joint blocks; block {i} is "
                                f"{'an SD3.5 dual-attention' if blk.use_dual_attention else 'the final context-only'} block")

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
        self.check_token_grid(grid)
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
        return self.read_out(reg, image_taps, text_taps, grid, temb)
