"""Variable-length text embeddings (Qwen-Image, Z-Image): padded rows with a mask, and trimming back.

The prompt cache stores each prompt's embedding at its own length ``(L_i, D)``. A batch is padded to a
fixed width (``max_sequence_length``) so that :class:`flowalign.protocols.Conditioning` tensors of
different batches concatenate; :func:`trim` cuts the shared padding again before a forward pass, so the
transformer sees exactly the batch-max padding the diffusers pipeline builds.
"""

from __future__ import annotations

import torch


def pad_rows(rows: list[torch.Tensor], length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[(L_i, D)]`` → embeddings ``(B, length, D)`` (zeros past each row, on the rows' device) and mask
    ``(B, length)`` int64 on the host: the lengths are read from it at every forward (:func:`trim`,
    :func:`unpad`), which from a GPU would make the host wait."""
    if any(r.shape[0] > length for r in rows):
        raise ValueError(f"a prompt embedding is longer than the padded width {length}")
    embeds = rows[0].new_zeros(len(rows), length, rows[0].shape[-1])
    mask = torch.zeros(len(rows), length, dtype=torch.long)
    for i, r in enumerate(rows):
        embeds[i, : r.shape[0]] = r
        mask[i, : r.shape[0]] = 1
    return embeds, mask


def trim(embeds: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Drop the padding every row shares: ``(B, L, D), (B, L)`` → ``(B, L', D), (B, L')`` with ``L'`` the
    longest row; the mask becomes None when no row is padded (as the pipelines pass it)."""
    longest = int(mask.sum(1).max())
    embeds, mask = embeds[:, :longest], mask[:, :longest]
    return embeds, (None if bool(mask.all()) else mask)


def unpad(embeds: torch.Tensor, mask: torch.Tensor) -> list[torch.Tensor]:
    """``(B, L, D), (B, L)`` → ``[(L_i, D)]``, each row cut to its own length (Z-Image's list input)."""
    return [e[: int(m.sum())] for e, m in zip(embeds, mask)]
