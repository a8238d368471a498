"""A prompt-conditioned video discriminator and its prompt-paired Bradley-Terry objective (AFD's critic).

``D(x, c)`` scores a clean video ``x`` for a prompt ``c``; the probability that the teacher's video of a prompt
is preferred over a student's of the same prompt is ``σ(D(x_T, c) − D(x_S, c))`` (Bradley-Terry). Trained on
prompt-paired samples only, ``D`` learns what separates the two *for the same prompt*: a property both share
(how hard the prompt is) cancels in the difference.

Model-agnostic: it reads pixels (``(B, F, 3, H, W)`` in [0, 1], resized to ``size``) and the prompt's words,
hashed into an embedding table of its own, so it needs no text encoder and works for any teacher and any
student. The video tower sees frames and frame differences (motion is what a causal student gets wrong
first) through strided 3-D convolutions; the score is an MLP on ``[video, text, video ⊙ text]``.
"""

from __future__ import annotations

import re
import zlib

import torch
import torch.nn.functional as F
from torch import nn


def word_ids(prompts: list[str], buckets: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompts' lower-case words hashed (CRC-32, the same in every process) into ``buckets``:
    ``(ids (W,), offsets (B,))`` for :class:`torch.nn.EmbeddingBag`; an empty prompt is one empty bag."""
    ids, offsets = [], []
    for prompt in prompts:
        offsets.append(len(ids))
        ids.extend(zlib.crc32(w.encode()) % buckets for w in re.findall(r"[a-z0-9]+", prompt.lower()))
    return torch.tensor(ids, dtype=torch.long), torch.tensor(offsets, dtype=torch.long)


class PromptPairedDiscriminator(nn.Module):
    """``D(videos (B, F, 3, H, W), prompts) → (B,)`` scores (higher: more teacher-like)."""

    def __init__(self, width: int = 32, size: int = 32, buckets: int = 4096) -> None:
        super().__init__()
        self.size, self.buckets = size, buckets
        self.video = nn.Sequential(
            nn.Conv3d(6, width, 3, stride=(1, 2, 2), padding=1), nn.SiLU(),
            nn.Conv3d(width, 2 * width, 3, stride=(1, 2, 2), padding=1), nn.SiLU(),
            nn.Conv3d(2 * width, 2 * width, 3, stride=2, padding=1), nn.SiLU(),
        )
        self.text = nn.EmbeddingBag(buckets, 2 * width, mode="mean")
        self.head = nn.Sequential(nn.Linear(6 * width, 2 * width), nn.SiLU(), nn.Linear(2 * width, 1))

    def forward(self, videos: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        b, f = videos.shape[:2]
        x = videos.float().flatten(0, 1)
        if x.shape[-2:] != (self.size, self.size):
            x = F.interpolate(x, size=(self.size, self.size), mode="bilinear", antialias=True, align_corners=False)
        x = x.unflatten(0, (b, f)).movedim(2, 1) * 2 - 1  # (B, 3, F, S, S) in [-1, 1]
        motion = torch.cat([torch.zeros_like(x[:, :, :1]), x[:, :, 1:] - x[:, :, :-1]], dim=2)
        v = self.video(torch.cat([x, motion], dim=1)).mean(dim=(2, 3, 4))
        ids, offsets = word_ids(prompts, self.buckets)
        t = self.text(ids.to(v.device), offsets.to(v.device))
        return self.head(torch.cat([v, t, v * t], dim=1)).squeeze(1)


def bradley_terry_loss(teacher: torch.Tensor, student: torch.Tensor) -> torch.Tensor:
    """``−mean log σ(D_T − D_S)`` over prompt-paired scores ``teacher (N,)``, ``student (N,)``: the negative
    log-likelihood that each teacher video beats the student video of its prompt."""
    return -F.logsigmoid(teacher - student).mean()
