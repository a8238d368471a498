"""A step's logged values, read back once: tensors and floats merged as the floats they stand for."""

from __future__ import annotations

import pytest
import torch

from flowalign.trainers.unit_logs import concatenated, merged, read_back, read_back_steps
from tests.flowalign.fake_device import DEVICE, FakeDevice, host_waits


def test_tensors_read_back_as_their_item_and_merge_with_floats():
    third = torch.tensor(1.0, dtype=torch.float32) / 3  # a float32 value: not the float 1/3
    stats = {"loss": [third, 0.25], "ratio_dev": [torch.tensor(0.5), torch.tensor(2.0, dtype=torch.float64), 1.0],
             "grad_norm": [torch.tensor([3.0])]}
    assert read_back(stats) == {"loss": [third.item(), 0.25], "ratio_dev": [0.5, 2.0, 1.0], "grad_norm": [3.0]}
    out = merged(stats)
    assert out["loss"] == pytest.approx((third.item() + 0.25) / 2, abs=0) and out["grad_norm"] == 3.0
    assert out["ratio_dev"] == 2.0  # the largest, not the mean
    assert all(type(v) is float for v in out.values())


def test_the_values_of_a_device_are_read_back_in_one_wait():
    with FakeDevice():
        stats = {k: [torch.tensor(float(i), device=DEVICE) for i in range(5)] for k in ("a", "b")}
        with host_waits() as found:
            out = merged({**stats, "c": [1.0]})
    assert out == {"a": 2.0, "b": 2.0, "c": 1.0} and [kind for kind, _ in found] == ["read values"]


def test_a_logged_value_that_is_not_a_scalar_is_refused_by_name():
    with pytest.raises(ValueError, match="'kl' has shape \\(2,\\)"):
        read_back({"kl": [torch.zeros(2)]})


def test_each_optimiser_steps_values_are_read_back_together_and_kept_apart():
    with FakeDevice():
        steps = [{"kl": [torch.tensor(0.5, device=DEVICE), 0.25], "grad_norm": [torch.tensor(1.0, device=DEVICE)]},
                 {"grad_norm": [torch.tensor(2.0, device=DEVICE)]}]
        with host_waits() as found:
            out = read_back_steps(steps)
    assert out == [{"kl": [0.5, 0.25], "grad_norm": [1.0]}, {"grad_norm": [2.0]}]
    assert [kind for kind, _ in found] == ["read values"]
    assert concatenated(out) == {"kl": [0.5, 0.25], "grad_norm": [1.0, 2.0]}
    with pytest.raises(ValueError, match="'kl' \\(optimiser step 1\\) has shape \\(2,\\)"):
        read_back_steps([{}, {"kl": [torch.zeros(2)]}])
