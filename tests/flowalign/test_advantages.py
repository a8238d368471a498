"""Advantage strategies (docs/methods/flow_grpo.md)."""

import pytest
import torch

from flowalign.advantages import (
    compute_advantages,
    gdpo_advantages,
    group_advantages,
    win_rates,
)


def test_group_advantages_use_population_std_per_group():
    r = torch.tensor([1.0, 2.0, 3.0, 10.0, 10.0, 40.0])
    g = torch.tensor([0, 0, 0, 1, 1, 1])
    a = group_advantages(r, g, eps=0.0)
    first = (r[:3] - 2.0) / torch.tensor([1.0, 2.0, 3.0]).std(unbiased=False)
    torch.testing.assert_close(a[:3], first)
    assert abs(a[3:].mean()) < 1e-6


def test_global_std_divides_by_std_of_all_rewards():
    r = torch.tensor([1.0, 3.0, 10.0, 30.0])
    g = torch.tensor([0, 0, 1, 1])
    a = group_advantages(r, g, std="global", eps=0.0)
    expected = torch.tensor([-1.0, 1.0, -10.0, 10.0]) / r.std(unbiased=False)
    torch.testing.assert_close(a, expected)


def test_gdpo_formula():
    """The default divides by the population std floored at 1e-6; ``std="population"`` (the former form) adds
    eps to it instead (the authors' form against their code: tests/flowalign/trainers/test_crosstimeedit_gdpo.py)."""
    torch.manual_seed(0)
    comps, weights = torch.rand(8, 2), torch.tensor([0.3, 0.7])
    g = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    for form, scale in (("floor", lambda std: std.clamp(min=1e-6)), ("population", lambda std: std + 1e-4)):
        per = []
        for m in range(2):
            col = comps[:, m]
            mean = torch.stack([col[g == k].mean() for k in g])
            std = torch.stack([col[g == k].std(unbiased=False) for k in g])
            per.append((col - mean) / scale(std))
        s = 0.3 * per[0] + 0.7 * per[1]
        expected = (s - s.mean()) / scale(s.std(unbiased=False))
        torch.testing.assert_close(gdpo_advantages(comps, weights, g, std=form), expected)


def test_gdpo_differs_from_normalising_the_weighted_sum():
    comps = torch.tensor([[0.0, 100.0], [1.0, 0.0], [0.0, 0.0], [1.0, 100.0]])
    g = torch.zeros(4, dtype=torch.long)
    w = torch.tensor([1.0, 1.0])
    assert not torch.allclose(compute_advantages("gdpo", comps, w, g), compute_advantages("group", comps, w, g))


def test_per_reward_sums_each_rewards_group_advantage_without_renormalising():
    """By hand: group (0, 1): reward a (1, 3) → (−1, 1), reward b (5, 5) → (0, 0); group (2, 3): a (2, 2) → 0,
    b (0, 4) → (−1, 1). Weights (1, 0.5): A = (−1, 1, −0.5, 0.5); one reward alone is its group advantage."""
    components = torch.tensor([[1.0, 5.0], [3.0, 5.0], [2.0, 0.0], [2.0, 4.0]])
    groups = torch.tensor([0, 0, 1, 1])
    out = compute_advantages("per_reward", components, torch.tensor([1.0, 0.5]), groups, eps=1e-12)
    torch.testing.assert_close(out, torch.tensor([-1.0, 1.0, -0.5, 0.5]))
    one = compute_advantages("per_reward", components[:, :1], torch.tensor([2.0]), groups)
    torch.testing.assert_close(one, 2 * compute_advantages("group", components[:, :1], torch.tensor([1.0]), groups))


def test_win_rates_count_pairwise_wins_with_ties_half():
    r = torch.tensor([0.1, 0.5, 0.5, 0.9])
    g = torch.zeros(4, dtype=torch.long)
    torch.testing.assert_close(win_rates(r, g), torch.tensor([0.0, 1.5 / 3, 1.5 / 3, 1.0]))


def test_win_rates_round_as_the_judge_reports_and_keep_float64():
    """``decimals=3`` is the authors' ``round(wins/compared, 3)``: 1.5/3 → 0.5, 1/3 → 0.333, 2/3 → 0.667."""
    r = torch.tensor([0.1, 0.5, 0.5, 0.9], dtype=torch.float64)
    g = torch.zeros(4, dtype=torch.long)
    got = win_rates(r, g, decimals=3)
    assert got.dtype == torch.float64
    assert got.tolist() == [0.0, 0.5, 0.5, 1.0]
    assert win_rates(torch.tensor([0.2, 0.1, 0.3, 0.4]), g, decimals=3).tolist() == pytest.approx(
        [0.333, 0.0, 0.667, 1.0], abs=1e-7)


def test_a_single_sample_batch_is_centred_not_divided_by_a_nan_std():
    one = compute_advantages("win_rate", torch.tensor([[0.3]]), torch.ones(1), torch.tensor([0]),
                             win_rate_normalisation="per_reward", batch_renormalise=True)
    assert one.tolist() == [0.0]


def test_advantages_are_clipped_and_zero_for_uniform_groups():
    r = torch.tensor([0.0, 0.0, 0.0, 1000.0, 1.0, 1.0])
    g = torch.tensor([0, 0, 0, 0, 1, 1])
    a = compute_advantages("group", r[:, None], torch.ones(1), g, clip=1.5)
    assert a.abs().max() <= 1.5
    assert torch.equal(a[4:], torch.zeros(2))
