"""The head of the authors' paper register architecture (``grid_pool``, their ``LatentRewardGridHead`` with the
per-reward ``score_mlps`` read by :class:`~rewards.latent_registers.grid.GridReward`): the same for every DiT
family, fed by the family's taps and register stream. See ``docs/methods/latent_registers.md``.

Per tap, a timestep-FiLM adapter ``proj((x·(1+γ(temb)) + β(temb)) + e_l)`` to ``width/4``; the taps are
concatenated and mixed (``agg_visual``, ``agg_text``) to ``width``. The registers, projected to ``width``
(``query_proj``), attend once over ``[registers; pooled image; text]`` in one softmax (``attn1``; RMS-normed
inputs, residual), optionally a second time over the image alone (``attn2``), then pass a residual
feed-forward (``norm_ff``, ``ff``). Parameter names are the authors'.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


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
