"""flowalign.budget and the EMA's warm-up: the pieces a pretraining stage reuses from the core."""

import pytest
import torch

from flowalign.budget import Budget, budget_fraction
from flowalign.ema import EMA


def test_the_larger_of_the_step_and_time_fractions_counts():
    assert budget_fraction(5, 10) == 0.5
    assert budget_fraction(5, 10, seconds=540, max_minutes=10) == 0.9
    assert budget_fraction(5, None, seconds=30, max_minutes=1) == 0.5
    assert budget_fraction(50, 10) == 1.0
    assert budget_fraction(3, 10, seconds=1e9, max_minutes=0) == 0.3  # 0 minutes: no time budget


def test_a_budget_carries_spent_time_over_a_resume():
    resumed = Budget(None, 1.0, elapsed=45.0)
    assert 0.75 <= resumed.fraction(0) < 0.8 and not resumed.done(0)
    assert Budget(None, 1.0, elapsed=60.0).done(0)
    assert Budget(4, None).done(4) and not Budget(4, None).done(3)
    with pytest.raises(ValueError, match="needs max_steps or max_minutes"):
        Budget(None, None)
