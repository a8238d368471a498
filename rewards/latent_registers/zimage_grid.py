"""Latent reward registers in the authors' paper architecture on Z-Image (``architecture: grid_pool`` on a
``ZImageTransformer2DModel``; theirs is ``zimage_latent_reward_grid_pool_nope_multihead``). See
``docs/methods/latent_registers.md``; what every family shares (parameters, head, files, the authors' folders) is
:class:`~rewards.latent_registers.grid.GridReward`.

Z-Image is a single-stream DiT: its front-end (patchify, ``x_embedder`` + ``noise_refiner`` on the image tokens,
``cap_embedder`` + ``context_refiner`` on the caption) builds one ``[image; caption]`` sequence with 3-axis RoPE,
which its main ``layers`` carry. The layer indices count those main layers (their preset on Z-Image-Turbo's 30:
taps 5, 10, 15, the register stream stopping at 15). Up to ``num_transformer_layers`` layers:

1. **A register stream.** ``M`` tokens ``reward_tokens`` modulated as the layer modulates its sequence
   (``attention_norm1(reg) · (1 + scale_msa)``, from ``adaLN_modulation`` of the σ embedding). Queries come from
   their own trainable ``reward_q_proj`` (then the layer's ``norm_q``), keys and values from the layer's frozen
   ``to_k`` (+ ``norm_k``) / ``to_v``; they attend over ``[registers; image; caption]`` in one softmax (keys and
   values of the layer's own input, batch padding masked). Unlike SD3 and FLUX the registers are rotated: RoPE
   at positions ``(L_cap + 1 + i, 0, 0)`` (``L_cap`` the caption's rows rounded up to 32, where the image tokens
   start on the first axis), as theirs. Then ``reg += tanh(gate_msa) · attention_norm2(to_out(attention))``: the
   layer's post-norm, no feed-forward. Image and caption tokens never see the registers: the layers run
   diffusers' own forward.
2. **Taps.** After layers ``feature_layers`` the image tokens are average-pooled by ``pool_factor`` on their
   ``(h/2, w/2)`` token grid (theirs: a fixed 64 × 64 at 1024 px) and the caption rows are kept, rows past a
   sample's own caption zeroed.
3. **The head** (:mod:`~rewards.latent_registers.grid_head`) reads the taps with ``temb_proj(adaln)``: Z-Image's
   σ embedding (``min(dim, 256)`` wide) through a trainable linear to the transformer's width (theirs), then
   ``score_mlps``.

``x`` is the latent ``(B, C, h, w)`` as flowalign's Z-Image policy holds it; the caption is ``prompt_embeds``
cut to each sample's ``prompt_embeds_mask`` (theirs cuts to the prompt's token count, the same rows); σ enters as
the policy's forward gives it (``t = 1 - σ``, scaled by the transformer's ``t_scale``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pad_sequence

from flowalign.errors import UserError
from flowalign.protocols import Conditioning
from pipelines._varlen import unpad
from rewards.latent_registers.base_model import ZIMAGE_CLASS_NAME
from rewards.latent_registers.grid import GridReward

CLASS_NAME = ZIMAGE_CLASS_NAME
COND_KEYS = ("prompt_embeds", "prompt_embeds_mask")
#: the authors' name for this architecture (``register.architecture`` in their ``config.yaml``)
AUTHORS_ARCHITECTURE = "zimage_latent_reward_grid_pool_nope_multihead"
#: the authors' Z-Image preset (``configs/register/zimage/paper.yaml``): taps at 1/6, 1/3, 1/2 of 30 layers
PAPER = {"heads": ["preference", "imagereward"], "feature_layers": [5, 10, 15], "text_layers": [5, 10, 15],
         "num_transformer_layers": 15, "layer_index_base": 1, "num_reward_tokens": 32, "num_attn_heads": 8,
         "pool_factor": 4, "width": -1, "head_hidden_factor": 2, "skip_attn2": True, "use_self_attn": True,
         "use_proj_in": False}
#: the patch size the authors' front-end runs (``patch_size=2, f_patch_size=1``), Z-Image-Turbo's only one
PATCH, F_PATCH = 2, 1
#: Z-Image's σ-embedding width cap (diffusers' ``ADALN_EMBED_DIM``)
ADALN_EMBED_DIM = 256


def paper_options(num_layers: int) -> dict[str, Any]:
    """The preset scaled to a Z-Image transformer of ``num_layers`` main layers: taps at 1/6, 1/3 and 1/2 of its
    depth rounded down (1-based, as their 5/10/15 of 30), the register stream stopping at the deepest tap.
    Z-Image-Turbo (30 layers) gets exactly ``PAPER``."""
    if num_layers < 2:
        raise UserError(f"the grid_pool registers need a transformer of at least 2 blocks; this one has {num_layers}")
    taps = sorted({max(1, num_layers * k // 6) for k in (1, 2, 3)})
    return {**PAPER, "feature_layers": taps, "text_layers": taps, "num_transformer_layers": max(taps)}


# ---------------------------------------------------------------------------------------------- the trunk
def rotate(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Z-Image's RoPE: ``x (B, N, H, d)`` by complex ``freqs (B or 1, N, d/2)``, in float32 (as its processor)."""
    z = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(z * freqs.unsqueeze(2)).flatten(3).type_as(x)


def modulation(block: nn.Module, adaln: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's attention ``(1 + scale_msa, tanh(gate_msa))``, each ``(B, 1, D)``, from ``adaln (B, E)``."""
    scale_msa, gate_msa, _, _ = block.adaLN_modulation(adaln).unsqueeze(1).chunk(4, dim=2)
    return 1.0 + scale_msa, gate_msa.tanh()


def keys_values(block: nn.Module, seq: torch.Tensor, freqs: torch.Tensor,
                adaln: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys (normed, rotated) and values ``(B, S, H, d)`` the layer computes from its input ``seq (B, S, D)``."""
    attn = block.attention
    scale, _ = modulation(block, adaln)
    h = block.attention_norm1(seq) * scale
    k = attn.to_k(h).unflatten(-1, (attn.heads, -1))
    if attn.norm_k is not None:
        k = attn.norm_k(k)
    return rotate(k, freqs), attn.to_v(h).unflatten(-1, (attn.heads, -1))


def register_step(block: nn.Module, reg: torch.Tensor, q_proj: nn.Linear, adaln: torch.Tensor, freqs: torch.Tensor,
                  keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Registers ``(B, M, D)`` (rotated by ``freqs (B, M, d/2)``) through one layer's attention over
    ``[registers; keys]`` (``mask (B, 1, 1, M+S)`` bool, True = attend), gated and post-normed as the layer."""
    attn = block.attention
    scale, gate = modulation(block, adaln)
    h = block.attention_norm1(reg) * scale
    q = F.linear(h, q_proj.weight.to(h.dtype), q_proj.bias.to(h.dtype)).unflatten(-1, (attn.heads, -1))
    k = attn.to_k(h).unflatten(-1, (attn.heads, -1))
    if attn.norm_q is not None:
        q = attn.norm_q(q)
    if attn.norm_k is not None:
        k = attn.norm_k(k)
    q, k = rotate(q, freqs), rotate(k, freqs)
    k = torch.cat([k, keys], 1)
    v = torch.cat([attn.to_v(h).unflatten(-1, (attn.heads, -1)), values], 1)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask)
    out = attn.to_out[0](out.transpose(1, 2).flatten(2))
    return reg + gate * block.attention_norm2(out)


def front_end(tr: nn.Module, images: list[torch.Tensor], captions: list[torch.Tensor], adaln: torch.Tensor):
    """``ZImageTransformer2DModel.forward``'s front-end (basic mode) by the transformer's own methods, with grad:
    ``(sequence (B, S, D), freqs (B, S, d/2), mask (B, S) bool or None, image rows, caption rows per sample)``,
    the sequence ``[image; caption]`` per sample, each part padded to a multiple of 32 rows."""
    device = images[0].device
    x, cap, _, x_pos, cap_pos, x_pad, cap_pad = tr.patchify_and_embed(images, captions, PATCH, F_PATCH)
    x_lens = [len(t) for t in x]
    x = tr.all_x_embedder[f"{PATCH}-{F_PATCH}"](torch.cat(x))
    x, x_freqs, x_mask, _, _ = tr._prepare_sequence(list(x.split(x_lens)), x_pos, x_pad, tr.x_pad_token, None, device)
    for layer in tr.noise_refiner:
        x = layer(x, x_mask, x_freqs, adaln, None, None, None)
    cap_lens = [len(t) for t in cap]
    cap = tr.cap_embedder(torch.cat(cap))
    cap, cap_freqs, cap_mask, _, _ = tr._prepare_sequence(list(cap.split(cap_lens)), cap_pos, cap_pad,
                                                          tr.cap_pad_token, None, device)
    for layer in tr.context_refiner:
        cap = layer(cap, cap_mask, cap_freqs)
    seq, freqs, mask, _ = tr._build_unified_sequence(x, x_freqs, x_lens, None, cap, cap_freqs, cap_lens, None,
                                                     None, None, None, None, False, device)
    return seq, freqs, mask, x_lens, cap_lens


class ZImageGridRegisters(GridReward):
    """:class:`~rewards.latent_registers.grid.GridReward` on a frozen Z-Image transformer (no family options:
    the token grid is read from the latent)."""

    family = "zimage"
    transformer_class = CLASS_NAME
    authors_architecture = AUTHORS_ARCHITECTURE
    paper_options = staticmethod(paper_options)

    @staticmethod
    def blocks_of(transformer: nn.Module) -> list[nn.Module]:
        return list(transformer.layers)

    @staticmethod
    def model_width(transformer: nn.Module) -> int:
        return int(transformer.config.dim)

    def check_blocks(self, blocks: list[nn.Module]) -> None:
        if any(not getattr(b, "modulation", False) for b in blocks):
            raise UserError("grid_pool registers on Z-Image need modulated main layers (adaLN_modulation)")

    def extra_parameters(self, dim: int) -> None:
        # Z-Image's σ embedding is min(dim, 256) wide; theirs bridges it to the head's width by a trainable linear
        self.temb_proj = nn.Linear(min(dim, ADALN_EMBED_DIM), dim)
        nn.init.xavier_uniform_(self.temb_proj.weight)
        nn.init.zeros_(self.temb_proj.bias)

    def features(self, x: torch.Tensor, sigma: float | torch.Tensor, cond: Conditioning) -> torch.Tensor:
        """Per-register head features ``(B, M, width)`` float32 of latents ``x (B, C, h, w)`` at ``σ`` (scalar
        or ``(B,)``), differentiable in ``x`` and in the reward's parameters."""
        if any(k not in cond.tensors for k in COND_KEYS):
            raise UserError("grid_pool registers on Z-Image need Z-Image conditioning (prompt_embeds, "
                            "prompt_embeds_mask): encode the prompts with a Z-Image policy")
        if x.ndim != 4:
            raise UserError(f"grid_pool registers on Z-Image score latents (B, C, h, w); got shape {tuple(x.shape)}")
        tr = self.transformer
        b = x.shape[0]
        if len(cond) != b:
            raise ValueError(f"score: x has batch {b} but cond has {len(cond)} prompts")
        if x.shape[2] % PATCH or x.shape[3] % PATCH:
            raise UserError(f"grid_pool registers on Z-Image: latent {x.shape[2]}x{x.shape[3]} is not divisible by "
                            f"the patch size {PATCH}")
        grid = (x.shape[2] // PATCH, x.shape[3] // PATCH)
        self.check_token_grid(grid)
        dtype, device = next(tr.parameters()).dtype, self.reward_tokens.device
        sigma = torch.as_tensor(sigma, dtype=torch.float32).to(device).flatten().expand(b)
        images = list(x.to(device, dtype).unsqueeze(2).unbind(0))  # (C, 1, h, w) each, as the policy passes them
        captions = unpad(cond.tensors["prompt_embeds"].to(device, dtype), cond.tensors["prompt_embeds_mask"].cpu())
        # Z-Image's time is t = 1 - σ (1 = clean), as the policy's forward and their fixed convention
        adaln = tr.t_embedder((1.0 - sigma) * tr.config.t_scale).type_as(images[0])
        seq, freqs, mask, x_lens, cap_lens = front_end(tr, images, captions, adaln)
        n_img, n_cap = x_lens[0], max(cap_lens)
        m = self.options["num_reward_tokens"]
        # the registers sit after each caption on the first RoPE axis, where that sample's image tokens start
        pos = torch.zeros(b, m, 3, dtype=torch.int32, device=device)
        pos[..., 0] = torch.arange(m, dtype=torch.int32, device=device) + torch.tensor(cap_lens, device=device)[:, None] + 1
        reg_freqs = tr.rope_embedder(pos.reshape(-1, 3)).reshape(b, m, -1)
        side_mask = None
        if mask is not None:
            side_mask = torch.cat([torch.ones(b, m, dtype=torch.bool, device=device), mask], 1)[:, None, None, :]
        # rows past a sample's own (rounded) caption are batch padding: zeroed in the text taps
        cap_valid = pad_sequence([torch.ones(n, 1, device=device, dtype=seq.dtype) for n in cap_lens], batch_first=True)
        reg = self.reward_tokens.to(dtype).unsqueeze(0).expand(b, -1, -1)
        image_taps: dict[int, torch.Tensor] = {}
        text_taps: dict[int, torch.Tensor] = {}
        for i, blk in enumerate(self.blocks_of(tr)[: self.stop]):
            # the layer's K,V from its own input; the layer then runs diffusers' own forward (a second K/V
            # projection, cheap next to the layer), so the generator's trunk is unchanged
            keys, values = keys_values(blk, seq, freqs, adaln)
            seq = blk(seq, mask, freqs, adaln)
            reg = register_step(blk, reg, self.reward_q_proj, adaln, reg_freqs, keys, values, side_mask)
            if i in self.image_taps:
                image_taps[i] = seq[:, : grid[0] * grid[1]]
            if i in self.text_taps:
                text_taps[i] = seq[:, n_img: n_img + n_cap] * cap_valid
        return self.read_out(reg, image_taps, text_taps, grid, self.temb_proj(adaln.to(self.reward_tokens.dtype)))
