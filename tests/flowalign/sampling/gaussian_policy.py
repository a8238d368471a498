"""An exact FlowPolicy for Gaussian data N(m, s²I): the rectified-flow velocity in closed form.

Not a stand-in for a model: it is the true optimum a perfect model would learn, which lets the tests
check the samplers' marginals against known answers.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from flowalign.protocols import Conditioning


def shifted_sigmas(num_steps: int, shift: float) -> torch.Tensor:
    """SD3-style time-shifted grid ``shift·t / (1 + (shift−1)·t)``, 1 → 0."""
    t = torch.linspace(1.0, 0.0, num_steps + 1)
    return shift * t / (1 + (shift - 1) * t)


class GaussianPolicy:
    family, is_video = "gaussian", False
    device, dtype = torch.device("cpu"), torch.float32

    def __init__(self, mean: float = 0.3, std: float = 0.5, dim: int = 4, shift: float = 3.0):
        self.m, self.s, self.dim, self.shift = mean, std, dim, shift
        self.trainable = torch.nn.Identity()
        self.defaults = {"guidance_scale": 1.0}

    def encode(self, prompts: list[str]) -> Conditioning:
        return Conditioning({"dummy": torch.zeros(len(prompts), 1)}, list(prompts))

    def initial_noise(self, n: int, generator: torch.Generator | None = None) -> torch.Tensor:
        return torch.randn(n, self.dim, generator=generator)

    def velocity(self, x, sigma, cond, guidance):
        sig = torch.as_tensor(sigma, dtype=torch.float32)
        if sig.ndim == 1:
            sig = sig.view(-1, 1)
        var = (1 - sig) ** 2 * self.s**2 + sig**2
        return (sig - (1 - sig) * self.s**2) / var * (x - (1 - sig) * self.m) - self.m

    def sigmas(self, num_steps: int) -> torch.Tensor:
        return shifted_sigmas(num_steps, self.shift)

    def decode(self, x0):
        return x0

    def adapter_disabled(self):
        return nullcontext()

    def save_adapter(self, directory) -> None:  # pragma: no cover - nothing to save
        pass
