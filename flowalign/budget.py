"""Training budgets: a number of steps, a number of minutes, or both (whichever runs out first).

Spent time is carried across resumes (``elapsed``), so an interrupted run stops where an uninterrupted
one would have; with a step budget only, every quantity derived from :meth:`Budget.fraction` (e.g. an
LR schedule) is the same in both.
"""

from __future__ import annotations

import time


def budget_fraction(step: int, max_steps: int | None, seconds: float = 0.0, max_minutes: float | None = None) -> float:
    """How much of the budget is spent, in [0, 1]: the larger of the step and the time fractions."""
    fractions = [0.0]
    if max_steps:
        fractions.append(step / max_steps)
    if max_minutes:
        fractions.append(seconds / (60 * max_minutes))
    return min(1.0, max(fractions))


class Budget:
    """A step and/or minute budget whose clock starts at construction, ``elapsed`` seconds already spent."""

    def __init__(self, max_steps: int | None, max_minutes: float | None, elapsed: float = 0.0):
        if not max_steps and not max_minutes:
            raise ValueError("a budget needs max_steps or max_minutes")
        self.max_steps, self.max_minutes = max_steps, max_minutes
        self.elapsed0, self.t0 = elapsed, time.perf_counter()

    @property
    def elapsed(self) -> float:
        """Seconds spent, earlier runs included."""
        return self.elapsed0 + time.perf_counter() - self.t0

    @property
    def seconds(self) -> float | None:
        return None if self.max_minutes is None else 60 * self.max_minutes

    def fraction(self, step: int) -> float:
        return budget_fraction(step, self.max_steps, self.elapsed, self.max_minutes)

    def done(self, step: int) -> bool:
        return self.fraction(step) >= 1.0
