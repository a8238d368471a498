"""A linear latent reward and a trainable toy flow for RG-OPD's exact properties.

``LinearLatentReward`` is a real (if simple) LatentReward loaded from a folder like any other, by the
``class`` named in its ``config.json``; ``BiasedGaussianPolicy`` is the exact Gaussian flow plus one
trainable velocity offset, so the distilled shift can be read off the parameter.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.flowalign.sampling.gaussian_policy import GaussianPolicy


class LinearLatentReward:
    """``r(x) = ⟨a, x⟩`` per sample (its gradient is the constant direction ``a``)."""

    def __init__(self, direction: list[float]):
        self.a = torch.tensor(direction, dtype=torch.float32)

    def score(self, x, sigma, cond):
        return (x.flatten(1).float() * self.a).sum(1)

    @classmethod
    def load(cls, folder, **kwargs):
        return cls(json.loads((Path(folder) / "config.json").read_text())["direction"])

    @staticmethod
    def write(folder: Path, direction: list[float]) -> Path:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps(
            {"class": "tests.flowalign.trainers.toy_latent:LinearLatentReward", "direction": direction}))
        return folder


class LinearHeadsLatentReward:
    """Several heads ``r_h(x) = ⟨a_h, x⟩`` per sample (head h's gradient is the constant ``a_h``); ``score``
    reads the first."""

    def __init__(self, directions: dict[str, list[float]]):
        self.a = {h: torch.tensor(d, dtype=torch.float32) for h, d in directions.items()}
        self.head_names = list(directions)

    def score_heads(self, x, sigma, cond):
        return {h: (x.flatten(1).float() * a).sum(1) for h, a in self.a.items()}

    def score(self, x, sigma, cond):
        return self.score_heads(x, sigma, cond)[self.head_names[0]]

    @classmethod
    def load(cls, folder, **kwargs):
        return cls(json.loads((Path(folder) / "config.json").read_text())["directions"])

    @staticmethod
    def write(folder: Path, directions: dict[str, list[float]]) -> Path:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps(
            {"class": "tests.flowalign.trainers.toy_latent:LinearHeadsLatentReward", "directions": directions}))
        return folder


class BiasedGaussianPolicy(GaussianPolicy):
    """Exact velocity of Gaussian data plus a trainable offset ``b`` ``(D,)``."""

    def __init__(self, dim: int = 4):
        super().__init__(dim=dim)
        self.trainable = torch.nn.Module()
        self.trainable.bias = torch.nn.Parameter(torch.zeros(dim))

    def velocity(self, x, sigma, cond, guidance):
        return super().velocity(x, sigma, cond, guidance) + self.trainable.bias
