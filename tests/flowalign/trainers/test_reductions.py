"""Masked reductions: the values and gradients of boolean-indexed ones, without a value-dependent size."""

from __future__ import annotations

import torch

from flowalign.trainers.parts.reductions import masked_max, masked_mean


def test_masked_mean_and_its_gradient_are_the_indexed_ones():
    g = torch.Generator().manual_seed(0)
    for mask in ([True, False, True, True, False, True], [False] * 5 + [True], [True] * 6):
        mask = torch.tensor(mask)
        x = torch.randn(6, generator=g, dtype=torch.float64, requires_grad=True)
        x.grad = None
        masked_mean(x, mask).backward()
        got = x.grad.clone()
        x.grad = None
        x[mask].mean().backward()
        assert torch.allclose(masked_mean(x, mask), x[mask].mean(), rtol=1e-15, atol=0)
        assert torch.equal(got, x.grad) and bool((got[~mask] == 0).all())


def test_an_empty_mask_gives_zero_and_no_gradient():
    x = torch.randn(4, requires_grad=True)
    empty = torch.zeros(4, dtype=torch.bool)
    out = masked_mean(x, empty)
    out.backward()
    assert out.item() == 0.0 and torch.equal(x.grad, torch.zeros(4))
    assert masked_max(x.detach().abs(), empty).item() == 0.0


def test_masked_max_is_the_largest_over_the_mask():
    x = torch.tensor([0.1, 5.0, 0.3, 0.2])
    assert masked_max(x, torch.tensor([True, False, True, True])).item() == x[2].item()
