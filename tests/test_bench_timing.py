"""The side-by-side's timing hooks: they count what each side trains without making the host wait."""

from __future__ import annotations

import torch

from tests.flowalign.fake_device import DEVICE, FakeDevice, host_waits
from tests.scripts import load_script

bench_timing = load_script("bench_timing")


class Denoiser(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, hidden_states: torch.Tensor, timestep: torch.Tensor) -> torch.Tensor:
        return self.proj(hidden_states) * timestep[:, None]


def test_trained_timesteps_are_counted_without_a_wait_at_each_forward():
    spans = bench_timing.Intervals()
    with FakeDevice():
        model = Denoiser().to(DEVICE)
        spans.hook(model, count_trained=True)
        x = torch.ones(2, 4, device=DEVICE)
        with host_waits() as found:
            for t in (0.9, 0.5, 0.9):  # under grad: two distinct timesteps
                model(hidden_states=x, timestep=torch.full((2,), t, device=DEVICE)).sum().backward()
            with torch.no_grad():  # a rollout forward is not counted
                model(hidden_states=x, timestep=torch.full((2,), 0.1, device=DEVICE))
        assert found == []  # the GPU would run ahead of every forward
        with host_waits() as read:
            assert spans.trained_timesteps() == 2
    assert read  # the one read back, after the iteration
    assert len(spans.spans) == 4
    spans.grad_timesteps.clear()
    assert spans.trained_timesteps() == 0
