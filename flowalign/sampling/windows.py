"""SDE windows: which steps of a rollout are stochastic (and therefore trained).

Flow-GRPO-Fast draws a random window start per prompt (or one per training step: :func:`shared_window_start`).
Steps outside the window run the deterministic ODE. The final step (σ' = 0) is deterministic unless asked for
(``last=True``): CPS has τ = 0 there, while the Flow-GRPO authors' sampler keeps it stochastic (and, with
``timestep_fraction`` 0.99, untrained).
"""

from __future__ import annotations

import torch


def sde_step_mask(num_steps: int, window: tuple[int, int] | torch.Tensor | None = None,
                  last: bool = False) -> torch.Tensor:
    """Bool mask ``(num_steps,)`` of the SDE steps.

    ``window`` is ``None`` (every step but the last), ``(start, width)`` (steps ``start … start+width-1``),
    or an explicit bool mask. The last step is excluded unless ``last`` (then a ``None`` window is every
    step, and an explicit mask is kept as given).
    """
    if window is None:
        mask = torch.ones(num_steps, dtype=torch.bool)
    elif isinstance(window, torch.Tensor):
        if window.shape != (num_steps,) or window.dtype != torch.bool:
            raise ValueError(f"an SDE window mask must be a bool tensor of shape ({num_steps},)")
        mask = window.clone()
    else:
        start, width = window
        if not (0 <= start and width >= 1 and start + width <= num_steps - 1):
            raise ValueError(
                f"SDE window (start={start}, width={width}) must lie within steps 0..{num_steps - 2} "
                "(the last step is deterministic)"
            )
        mask = torch.zeros(num_steps, dtype=torch.bool)
        mask[start : start + width] = True
    if window is None or not isinstance(window, torch.Tensor):
        mask[num_steps - 1] = last and window is None
    elif not last:
        mask[num_steps - 1] = False
    return mask


def random_window_start(
    num_steps: int, width: int, generator: torch.Generator, low: int = 0, high: int | None = None
) -> int:
    """Flow-GRPO-Fast: ``k0 ~ U{low … high − width}`` (``high`` defaults to ``num_steps // 2``).

    Draw from a seeded generator shared by every rank that holds the same prompt group.
    """
    high = num_steps // 2 if high is None else high
    last = min(high - width, num_steps - 1 - width)
    if last < low:
        raise ValueError(f"no room for an SDE window of width {width} in steps {low}..{high} of {num_steps}")
    return int(torch.randint(low, last + 1, (1,), generator=generator).item())


def shared_window_start(num_steps: int, width: int, seed: int, low: int = 0, high: int | None = None) -> int:
    """One window start for a whole training step, drawn as Flow-Factory's SDE scheduler draws its SDE steps
    (``FlowMatchEulerDiscreteSDEScheduler.current_sde_steps``): the first of a permutation of the eligible
    starts ``low … high − width`` (the range of :func:`random_window_start`) from a generator seeded with
    ``seed``. Seeded with ``run.seed + step`` it is the same on every rank and for every prompt of the step,
    and at width 1 it is the step the CrossTimeEdit authors' scheduler draws at epoch ``step`` with
    ``sde_steps`` ``low … high − 1`` and training seed ``run.seed`` (they seed it with ``seed + epoch``).
    """
    high = num_steps // 2 if high is None else high
    last = min(high - width, num_steps - 1 - width)
    if last < low:
        raise ValueError(f"no room for an SDE window of width {width} in steps {low}..{high} of {num_steps}")
    pick = torch.randperm(last + 1 - low, generator=torch.Generator().manual_seed(seed))[0]
    return low + int(pick)


def sliding_window(step: int, num_steps: int, width: int, shift_interval: int, stride: int = 1) -> tuple[int, int]:
    """MixGRPO's progressive SDE window ``(start, width)`` at training step ``step`` (0-based).

    The window starts at step 0 and moves ``stride`` steps later every ``shift_interval`` training steps; past
    the last start it rolls back to 0 (the authors' ``roll_back``). A ``stride`` of 0 keeps it at step 0 (their
    ``prog_overlap_step 0``, MixGRPO-Flash*'s frozen window). As the authors bound it, the window covers
    ``[start, min(start + width, T − 2))``, so it narrows near the end and never touches the last two steps;
    the starts are ``0, stride, 2·stride, … ≤ T − 3`` (a start of ``T − 2`` would leave it empty). A pure
    function of the step: the same on every rank, and after a resume.
    """
    if num_steps < 3:
        raise ValueError(f"a sliding SDE window needs at least 3 sampling steps, got {num_steps}")
    if width < 1 or shift_interval < 1 or stride < 0:
        raise ValueError("sliding window width and shift_interval must each be >= 1, and stride >= 0")
    if stride == 0:
        return 0, min(width, num_steps - 2)
    starts = (num_steps - 3) // stride + 1
    start = (step // shift_interval) % starts * stride
    return start, min(start + width, num_steps - 2) - start
