"""A step's samples shuffled and dealt into disjoint parts, one per optimiser step, the same in any rank layout
(DiffusionNFT's ``gradient_step_per_epoch``: ``docs/methods/diffusion_nft.md``)."""

from __future__ import annotations

import numpy as np
import torch


def sample_keys(groups: torch.Tensor) -> torch.Tensor:
    """``(N, 2)`` identity ``(group, member)`` of each sample of a batch whose global group ids are ``groups``
    ``(N,)``: member is the sample's place among its group's samples in batch order (a group lives on one
    rank, so the key names the same sample whichever rank holds it)."""
    seen: dict[int, int] = {}
    members = []
    for g in groups.tolist():
        members.append(seen.get(g, 0))
        seen[g] = members[-1] + 1
    return torch.stack([groups.long(), torch.tensor(members, dtype=torch.long)], dim=1)


def sample_parts(mine: torch.Tensor, every: torch.Tensor, parts: int, generator: torch.Generator) -> torch.Tensor:
    """The part in ``[0, parts)`` of each of this rank's samples ``mine`` ``(N, 2)`` (keys of
    :func:`sample_keys`), among every rank's samples ``every`` ``(M, 2)`` (``mine`` included).

    Every rank's samples, in key order, are permuted by ``generator`` (the same on every rank) and the
    permutation is cut into ``parts`` runs of equal size (the first ``M mod parts`` one longer): position p
    of the permutation goes to the run holding p, as the authors cut their shuffled batch into
    consecutive micro-batches and step once per ``gradient_accumulation_steps`` of them. Nothing depends
    on which rank holds a sample, so one process holding all the samples gets the same parts.
    Returns ``(N,)`` long.
    """
    width = int(every[:, 1].max()) + 1 if len(every) else 1

    def flat(keys: torch.Tensor) -> torch.Tensor:  # one number per key, ordered as the keys
        return keys[:, 0] * width + keys[:, 1]

    ordered = torch.sort(flat(every)).values
    perm = torch.randperm(len(ordered), generator=generator)
    sizes = [len(run) for run in np.array_split(np.arange(len(ordered)), parts)]
    part_of_ordered = torch.empty(len(ordered), dtype=torch.long)
    part_of_ordered[perm] = torch.repeat_interleave(torch.arange(parts), torch.tensor(sizes))
    return part_of_ordered[torch.searchsorted(ordered, flat(mine))]
