"""MixGRPO-Flash's compressed ODE tail (``docs/methods/mix_grpo.md``).

After a rollout's last SDE step, nothing more is trained, so MixGRPO-Flash finishes the trajectory on a shorter
σ grid with a higher-order solver: the rest of the shifted grid is re-spaced to a fraction of its points and
integrated with multistep DPM-Solver++(2), whose first step already takes the second-order update from the
clean prediction of the window's last step. The steps up to and through the window keep the grid and its
steps as they are, so every trained step sees the same σ pair as without the tail.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flowalign.sampling.ode_solvers import DPMSolverSteps
from flowalign.sampling.steps import StepFn, StepOutput
from flowalign.sampling.timesteps import shifted_grid, time_shift


@dataclass(frozen=True)
class CompressedTail:
    """The ODE after the SDE window on a compressed grid (compared by value: equal tails share a rollout batch).

    ``shift``: the shift of the rollout's :func:`~flowalign.sampling.timesteps.shifted_grid` (the tail re-spaces
    that grid, and is refused on any other); ``ratio``: the share of the grid's remaining points kept (the
    authors' ``dpm_post_compress_ratio``: 0.4 for MixGRPO-Flash, 0.2 for Flash*).
    """

    shift: float
    ratio: float

    def __post_init__(self) -> None:
        if not (0 < self.ratio <= 1):
            raise ValueError(f"CompressedTail.ratio must lie in (0, 1], got {self.ratio}")

    def sigmas(self, num_steps: int, last: int) -> torch.Tensor:
        """``(L + 1,)`` float32: the shifted grid's points ``0 … last`` (through the window's last step ``last``),
        then ``P`` points from its time ``u_{last+1}`` down to 0, evenly spaced in ``u`` and time-shifted.

        ``P = int((T − last)·ratio)`` as the authors' ``run_sample_step`` counts it, but at least 2: theirs keeps
        at least 1, which ends a rollout whose window comes within 4 steps of the end (at ratio 0.4) at
        σ_{last+1} > 0, still noisy (their 300 FLUX steps never reach such a window).
        """
        if not 0 <= last < num_steps - 1:
            raise ValueError(f"a compressed tail follows an SDE window ending at step {last}: it must end before "
                             f"the last step {num_steps - 1}")
        u_next = torch.linspace(1, 0, num_steps + 1)[last + 1].item()
        points = max(int((num_steps - last) * self.ratio), 2)
        tail = time_shift(torch.linspace(u_next, 0, points), self.shift)
        return torch.cat([shifted_grid(num_steps, self.shift)[: last + 1], tail])

    def apply(self, sigmas: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, "TailSteps"]:
        """A rollout's grid ``(T + 1,)`` and SDE mask ``(T,)`` with the tail in place: the compressed grid
        ``(L + 1,)``, the mask ``(L,)`` (the tail's steps deterministic) and the steps after the window."""
        num_steps = len(mask)
        if not torch.equal(sigmas.float(), shifted_grid(num_steps, self.shift)):
            raise ValueError(f"a compressed tail re-spaces the grid shifted by {self.shift}; this rollout runs on "
                             "another (set the trainer's sigma_grid: shifted)")
        if not mask.any():
            raise ValueError("a compressed tail follows the SDE window: this rollout has no SDE step")
        last = int(mask.nonzero().max())
        grid = self.sigmas(num_steps, last)
        tail_mask = torch.cat([mask[: last + 1], torch.zeros(len(grid) - last - 2, dtype=torch.bool)])
        return grid, tail_mask, TailSteps(grid, last)


class TailSteps:
    """The steps of one rollout's tail along its compressed grid ``(L + 1,)``: step ``last`` (the window's last)
    runs as given and leaves its clean prediction ``x̂0 = x − σ·v`` as the multistep history; steps ``last + 1 …
    L − 1`` are DPM-Solver++(2) (first order on the step to σ = 0). Build one per rollout."""

    def __init__(self, sigmas: torch.Tensor, last: int):
        self.last = last
        self.dpm = DPMSolverSteps(sigmas)

    def through(self, step: StepFn) -> StepFn:
        """``step`` at the window's last step, keeping its clean prediction for the tail."""

        def window_step(v, x, sigma, sigma_next, generator, prev_sample):
            self.dpm.resume_at(self.last + 1, x.float() - sigma * v.float())
            return step(v, x, sigma, sigma_next, generator, prev_sample)

        return window_step

    def __call__(self, v, x, sigma, sigma_next, generator=None, prev_sample=None) -> StepOutput:
        return self.dpm(v, x, sigma, sigma_next, generator, prev_sample)
