"""A run's rewards as one object: a weighted set with masking and per-reward logs.

``rewards:`` in a run config lists ``(name, weight, reward)``; every place that combines them (the
loop's scoring, advantages, DiffusionOPSD's reward gradient, FestDPO's preference labels) goes through
:class:`RewardSet`, so the weighted sum and its masking rule exist once:

    total_i = Σ_m w_m · R_m(x_i)   over the rewards valid for sample i; sample i is valid when every R_m is.

A reward that raises, or returns a non-finite value, marks those samples invalid (masked, never scored
zero). An empty set (reward-free trainers such as SOAR and SFT) scores every sample valid with total 0.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from flowalign.errors import UserError
from flowalign.protocols import Reward, RewardOutput
from flowalign.reward_check import check_reward_output


@dataclass
class RewardScores:
    """Scores of ``N`` samples under ``M`` rewards.

    ``values (N, M)`` float32 raw reward values (0 where invalid); ``ok (N, M)`` bool validity per
    reward; ``weights (M,)``; ``names`` the M reward names.
    """

    values: torch.Tensor
    ok: torch.Tensor
    weights: torch.Tensor
    names: list[str]

    def __len__(self) -> int:
        return self.values.shape[0]

    @property
    def valid(self) -> torch.Tensor:
        """``(N,)`` bool: every reward valid for the sample."""
        return self.ok.all(dim=1)

    @property
    def total(self) -> torch.Tensor:
        """``(N,)`` the weighted sum ``values @ weights`` (invalid components count 0)."""
        return self.values @ self.weights

    def logs(self) -> dict[str, float]:
        """``reward/<name>`` (mean over the valid samples) and ``reward/<name>_invalid_fraction``."""
        out = {}
        for m, name in enumerate(self.names):
            ok = self.ok[:, m]
            out[f"reward/{name}"] = self.values[ok, m].mean().item() if ok.any() else float("nan")
            out[f"reward/{name}_invalid_fraction"] = 1.0 - ok.float().mean().item()
        return out

    @staticmethod
    def cat(parts: list["RewardScores"]) -> "RewardScores":
        """Scores of consecutive batches as one."""
        return RewardScores(torch.cat([p.values for p in parts]), torch.cat([p.ok for p in parts]),
                            parts[0].weights, parts[0].names)


class RewardSet:
    """Weighted rewards ``[(name, weight, reward), ...]``; iterating yields those triples."""

    def __init__(self, entries: Iterable[tuple[str, float, Reward]] = ()):
        self.entries = [(str(n), float(w), r) for n, w, r in entries]

    @classmethod
    def of(cls, rewards: "RewardSet | Iterable[tuple[str, float, Reward]]") -> "RewardSet":
        return rewards if isinstance(rewards, RewardSet) else cls(rewards)

    def __iter__(self) -> Iterator[tuple[str, float, Reward]]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def names(self) -> list[str]:
        return [n for n, _, _ in self.entries]

    @property
    def weights(self) -> torch.Tensor:
        """``(M,)`` float32."""
        return torch.tensor([w for _, w, _ in self.entries], dtype=torch.float32)

    def not_differentiable(self) -> list[str]:
        """Names of the rewards through which no gradient flows to the samples."""
        return [n for n, _, r in self.entries if not getattr(r, "differentiable", False)]

    @torch.no_grad()
    def score(self, samples: torch.Tensor, prompts: list[str], metadata: list[dict[str, Any]]) -> RewardScores:
        """Every reward on decoded samples ``(N, 3, H, W)`` or ``(N, F, 3, H, W)``; never raises for a
        reward's failure (its samples are marked invalid and a warning printed), only for a reward that
        returns the wrong kind of output (``UserError``)."""
        n = len(prompts)
        columns, oks = [], []
        for name, _, reward in self.entries:
            try:
                out: RewardOutput = check_reward_output(name, reward(samples, prompts, metadata), n)
                value = out.total.float().cpu()
                ok = out.valid.cpu().bool() & torch.isfinite(value)
            except UserError:  # a reward that returns the wrong thing fails every batch: say so once
                raise
            except Exception as e:  # a reward that raises invalidates the batch's samples, not the run
                print(f"warning: reward {name!r} raised {type(e).__name__}: {e}")
                value, ok = torch.zeros(n), torch.zeros(n, dtype=torch.bool)
            columns.append(torch.where(ok, value, torch.zeros_like(value)))
            oks.append(ok)
        values = torch.stack(columns, dim=1) if columns else torch.zeros(n, 0)
        ok = torch.stack(oks, dim=1) if oks else torch.ones(n, 0, dtype=torch.bool)
        return RewardScores(values, ok, self.weights, self.names)

    def weighted_total(self, samples: torch.Tensor, prompts: list[str], metadata: list[dict[str, Any]]) -> torch.Tensor:
        """``(N,)`` ``Σ_m w_m·R_m`` with gradients to ``samples`` where the rewards have them; invalid
        components count 0 (they give no gradient)."""
        total = torch.zeros(len(prompts), device=samples.device)
        for name, weight, reward in self.entries:
            out = check_reward_output(name, reward(samples, prompts, metadata), len(prompts))
            value = out.total.to(samples.device)
            total = total + weight * torch.where(out.valid.to(samples.device), value, 0.0)
        return total
