"""Small programmatic rewards for trainer tests (real rewards: they score pixels, deterministically)."""

import torch


def redness(samples: torch.Tensor, prompts, metadata) -> torch.Tensor:
    """Mean red minus mean green/blue: ``(B,)``."""
    return samples[:, 0].flatten(1).mean(1) - samples[:, 1:].flatten(1).mean(1)


def sometimes_nan(samples: torch.Tensor, prompts, metadata) -> torch.Tensor:
    """``redness`` but NaN for every fourth sample (a reward that fails on some inputs)."""
    r = redness(samples, prompts, metadata)
    r[::4] = float("nan")
    return r


#: (start, end) perf_counter times of every ``slow_redness`` call, in call order
SLOW_CALLS: list[tuple[float, float]] = []


def slow_redness(samples: torch.Tensor, prompts, metadata) -> torch.Tensor:
    """``redness`` after 0.4 s (a judge behind a network call), recording when each call ran."""
    import time

    start = time.perf_counter()
    time.sleep(0.4)
    out = redness(samples, prompts, metadata)
    SLOW_CALLS.append((start, time.perf_counter()))
    return out


def redness_of_red_prompts(samples: torch.Tensor, prompts, metadata) -> torch.Tensor:
    """``redness`` for prompts that name red, 0 for the others (their groups get zero advantages)."""
    r = redness(samples, prompts, metadata)
    return torch.where(torch.tensor(["red" in p for p in prompts]), r, torch.zeros_like(r))


def constant(samples: torch.Tensor, prompts, metadata) -> torch.Tensor:
    """The same score for every sample: every group ties."""
    return torch.zeros(samples.shape[0])
