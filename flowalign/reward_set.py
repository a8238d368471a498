"""A run's rewards as one object: a weighted set with masking and per-reward logs.

``rewards:`` in a run config lists ``(name, weight, reward)``; every place that combines them (the
loop's scoring, advantages, DiffusionOPSD's reward gradient, FestDPO's preference labels) goes through
:class:`RewardSet`, so the weighted sum and its masking rule exist once:

    total_i = Σ_m w_m · R_m(x_i)   over the rewards valid for sample i; sample i is valid when every R_m is.

A reward that raises (anything but ``KeyboardInterrupt``: a plug-in's ``SystemExit`` too), or returns a
non-finite value, marks those samples invalid (masked, never scored zero), each with a reason
(``RewardScores.reasons``: the reward's own ``info[i]["reason"]`` when it gives one). An empty set
(reward-free trainers such as SOAR and SFT) scores every sample valid with total 0. A reward given an
``invalid_value`` scores the samples it leaves invalid, whatever the cause, at that value instead of masking them
(some authors' scripts score a judge's reply without a score 0); its invalid fraction is still logged.

Every reward a run or an evaluation loads runs each call in a worker thread under a deadline
(:class:`TimeLimited`: the entry's ``timeout_s``, default :data:`flowalign.config.REWARD_TIMEOUT_S`); a
call that has not returned by then is abandoned and its batch is invalid ("no answer within N s"). A
Python thread cannot be killed: the abandoned call goes on in the background until it returns, and
until it does the reward's next calls are refused (invalid at once) rather than stacked on top of it.
SIGTERM is never a reward's failure: it ends the wait and goes on up (:mod:`flowalign.signals`).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from flowalign.errors import UserError
from flowalign.protocols import FeatureReward, Reward, RewardOutput
from flowalign.reward_check import check_reward_output
from flowalign.signals import Abandoned, Terminated, should_abandon


@dataclass
class RewardScores:
    """Scores of ``N`` samples under ``M`` rewards.

    ``values (N, M)`` float32 raw reward values (0 where invalid); ``ok (N, M)`` bool validity per
    reward; ``weights (M,)``; ``names`` the M reward names; ``reasons`` per sample, why it is invalid
    (``"<reward>: <reason>"``, the first invalid reward's) or ``""``; ``pairwise (M,)`` bool: the reward is
    a pairwise judge whose value already is a win rate among the samples sharing a prompt (a reward
    declares it with a true ``pairwise`` attribute; None: none is).
    """

    values: torch.Tensor
    ok: torch.Tensor
    weights: torch.Tensor
    names: list[str]
    reasons: list[str] | None = None
    #: reward name → ``(N,)`` bool verdicts, for each reward whose ``info`` gives every sample ``all_passed``
    #: (a benchmark's pass/fail, e.g. GenEval's strict verdict beside a partial score); False where invalid
    passed: dict[str, torch.Tensor] = field(default_factory=dict)
    pairwise: torch.Tensor | None = None
    #: reward name → ``(N,)`` per-sample notes, for each reward whose ``info`` gives a sample a ``note`` (e.g.
    #: motion_insight's failure causes): evaluations keep them beside each sample, galleries show them
    notes: dict[str, list[str]] = field(default_factory=dict)
    #: reward name → ``(N, 5)`` float per-sample parts of a score that is a blend of two, for each reward with a
    #: ``blend_parts`` attribute (the five ``info`` keys it reads, in order: the two parts, whether the sample's
    #: score blends them, their two weights; UnifiedReward-Flex's ``[overall, dim_mean, has_dims, overall_weight,
    #: dim_weight]``, UnifiedReward-Edit's pointwise scores), NaN rows where a sample has none (or the reward
    #: failed: every rank holds the same names, which the advantages gather); Pref-GRPO's advantages blend the
    #: parts' advantages (:func:`flowalign.advantages.per_reward_win_rate_advantages`)
    parts: dict[str, torch.Tensor] = field(default_factory=dict)
    #: reward name → ``(N,)`` bool: the samples the reward left invalid that were scored at its
    #: ``invalid_value`` instead (valid in ``ok``), for each reward given one
    substituted: dict[str, torch.Tensor] = field(default_factory=dict)

    def commonest_reason(self) -> tuple[str, int] | None:
        """The reason most invalid samples share, and how many share it (None when all are valid)."""
        reasons = [r for r, ok in zip(self.reasons or [""] * len(self), self.valid.tolist()) if not ok]
        return Counter(r or "no reason given" for r in reasons).most_common(1)[0] if reasons else None

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
        """``reward/<name>`` (mean over the valid samples, those scored at an ``invalid_value`` included) and
        ``reward/<name>_invalid_fraction`` (the samples the reward itself left invalid)."""
        out = {}
        for m, name in enumerate(self.names):
            ok = self.ok[:, m]
            failed = ~ok | self.substituted.get(name, torch.zeros_like(ok))
            out[f"reward/{name}"] = self.values[ok, m].mean().item() if ok.any() else float("nan")
            out[f"reward/{name}_invalid_fraction"] = failed.float().mean().item()
        return out

    @staticmethod
    def cat(parts: list["RewardScores"]) -> "RewardScores":
        """Scores of consecutive batches as one."""
        # a batch whose reward failed has no verdicts: its samples are invalid, so they count as failed
        verdicts = dict.fromkeys(name for p in parts for name in p.passed)
        passed = {name: torch.cat([p.passed.get(name, torch.zeros(len(p), dtype=torch.bool)) for p in parts])
                  for name in verdicts}
        notes = {name: [t for p in parts for t in p.notes.get(name, [""] * len(p))]
                 for name in dict.fromkeys(name for p in parts for name in p.notes)}
        blends = {name: torch.cat([p.parts.get(name, torch.full((len(p), 5), float("nan"), dtype=torch.float64))
                                   for p in parts])
                  for name in dict.fromkeys(name for p in parts for name in p.parts)}
        substituted = {name: torch.cat([p.substituted.get(name, torch.zeros(len(p), dtype=torch.bool)) for p in parts])
                       for name in dict.fromkeys(name for p in parts for name in p.substituted)}
        return RewardScores(torch.cat([p.values for p in parts]), torch.cat([p.ok for p in parts]),
                            parts[0].weights, parts[0].names,
                            [r for p in parts for r in (p.reasons or [""] * len(p))], passed, parts[0].pairwise, notes,
                            blends, substituted)


class RewardSet:
    """Weighted rewards ``[(name, weight, reward), ...]``; iterating yields those triples. ``invalid_values``:
    reward name → the value its invalid samples are scored at instead of being masked (the rewards not named
    mask them)."""

    def __init__(self, entries: Iterable[tuple[str, float, Reward]] = (), invalid_values: dict[str, float] | None = None):
        self.entries = [(str(n), float(w), r) for n, w, r in entries]
        self.invalid_values = dict(invalid_values or {})
        unknown = set(self.invalid_values) - set(self.names)
        if unknown:
            raise ValueError(f"invalid_values names {sorted(unknown)}, not rewards of the set {self.names}")
        for name, _, reward in self.entries:
            if name in self.invalid_values and getattr(reward, "blend_parts", ()):
                # its advantages blend the parts each sample's reply gave, which a failed sample has none of
                raise UserError(f"reward {name!r}: invalid_value does not apply to a reward whose advantages blend the "
                                "parts of its judgements (its invalid samples have none); drop invalid_value")

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

    @property
    def pairwise(self) -> torch.Tensor:
        """``(M,)`` bool: which rewards are pairwise judges (their value is a within-prompt win rate)."""
        return torch.tensor([bool(getattr(r, "pairwise", False)) for _, _, r in self.entries],
                            dtype=torch.bool)

    def embedding_reward(self) -> tuple[float, FeatureReward] | None:
        """``(weight, reward)`` when the set is one reward that scores an image embedding
        (:class:`~flowalign.protocols.FeatureReward`: CLIP score, HPS, PickScore, aesthetic), else None."""
        if len(self.entries) == 1 and isinstance(self.entries[0][2], FeatureReward):
            return self.entries[0][1], self.entries[0][2]
        return None

    def not_differentiable(self) -> list[str]:
        """Names of the rewards through which no gradient flows to the samples."""
        return [n for n, _, r in self.entries if not getattr(r, "differentiable", False)]

    @torch.no_grad()
    def score(self, samples: torch.Tensor, prompts: list[str], metadata: list[dict[str, Any]]) -> RewardScores:
        """Every reward on decoded samples ``(N, 3, H, W)`` or ``(N, F, 3, H, W)``; never raises for a
        reward's failure or silence past its deadline (its samples are marked invalid and a warning
        printed), only for a reward that returns the wrong kind of output (``UserError``); Ctrl-C and
        SIGTERM go on up."""
        n = len(prompts)
        columns, oks, reasons = [], [], [""] * n
        passed: dict[str, torch.Tensor] = {}
        notes: dict[str, list[str]] = {}
        blends: dict[str, torch.Tensor] = {}
        substituted: dict[str, torch.Tensor] = {}
        for name, _, reward in self.entries:
            try:
                out: RewardOutput = check_reward_output(name, reward(samples, prompts, metadata), n)
                value = out.total.float().cpu()
                ok = out.valid.cpu().bool() & torch.isfinite(value)
                why = [_reason(out, i, value) for i in range(n)]
                if _has_verdicts(out, n):
                    passed[name] = torch.tensor([bool(info["all_passed"]) for info in out.info]) & ok
                if any(isinstance(info, dict) and info.get("note") for info in out.info):
                    notes[name] = [str(info.get("note") or "") if isinstance(info, dict) else "" for info in out.info]
                if getattr(reward, "blend_parts", ()):
                    blends[name] = _blend_parts(out.info, n, reward.blend_parts)
            except (UserError, KeyboardInterrupt, Terminated):  # a wrong output fails every batch; a signal is
                raise                                                # the user's, never the reward's failure
            except BaseException as e:  # raised, timed out, even SystemExit: the batch's samples, not the run
                message = f"raised {type(e).__name__}: {e}" if not isinstance(e, RewardTimeout) else str(e)
                print(f"warning: reward {name!r} {message}; its batch of {n} samples is invalid", flush=True)
                value, ok, why = torch.zeros(n), torch.zeros(n, dtype=torch.bool), [message] * n
                if getattr(reward, "blend_parts", ()):
                    blends[name] = _blend_parts([], n, reward.blend_parts)
            if name in self.invalid_values:  # scored at the value the config gives, not masked
                substituted[name] = ~ok
                value = torch.where(ok, value, torch.tensor(self.invalid_values[name], dtype=value.dtype))
                ok = torch.ones_like(ok)
            for i in range(n):
                if not ok[i] and not reasons[i]:
                    reasons[i] = f"{name}: {why[i]}"
            columns.append(torch.where(ok, value, torch.zeros_like(value)))
            oks.append(ok)
        values = torch.stack(columns, dim=1) if columns else torch.zeros(n, 0)
        ok = torch.stack(oks, dim=1) if oks else torch.ones(n, 0, dtype=torch.bool)
        return RewardScores(values, ok, self.weights, self.names, reasons, passed, self.pairwise, notes, blends,
                            substituted)

    def weighted_total(self, samples: torch.Tensor, prompts: list[str], metadata: list[dict[str, Any]]) -> torch.Tensor:
        """``(N,)`` ``Σ_m w_m·R_m`` with gradients to ``samples`` where the rewards have them; invalid
        components count 0 (they give no gradient)."""
        total = torch.zeros(len(prompts), device=samples.device)
        for name, weight, reward in self.entries:
            try:
                out = check_reward_output(name, reward(samples, prompts, metadata), len(prompts))
            except RewardTimeout as e:  # no answer: its components are invalid, they count 0
                print(f"warning: reward {name!r} {e}; it adds nothing for this batch of {len(prompts)} samples",
                      flush=True)
                continue
            except (Exception, KeyboardInterrupt, Terminated):
                raise
            except BaseException as e:  # a plug-in's SystemExit would end the run without a word
                raise RuntimeError(f"reward {name!r} raised {type(e).__name__}: {e}") from e
            value = out.total.to(samples.device)
            total = total + weight * torch.where(out.valid.to(samples.device), value, 0.0)
        return total


def _blend_parts(info: list[Any], n: int, keys: tuple[str, ...]) -> torch.Tensor:
    """``(n, 5)`` :attr:`RewardScores.parts` of a blended score from each sample's ``info`` at ``keys`` (NaN
    without)."""
    rows = [[float("nan") if i >= len(info) or not isinstance(info[i], dict) or info[i].get(k) is None
             else float(info[i][k]) for k in keys] for i in range(n)]
    return torch.tensor(rows, dtype=torch.float64)


def _has_verdicts(out: RewardOutput, n: int) -> bool:
    """Whether ``out`` gives each of its ``n`` samples a pass/fail verdict (``info[i]["all_passed"]``)."""
    return len(out.info) == n and all(isinstance(info, dict) and "all_passed" in info for info in out.info)


def _reason(out: RewardOutput, i: int, value: torch.Tensor) -> str:
    """Why sample ``i`` of ``out`` is invalid: the reward's own ``info[i]["reason"]``, else what is seen."""
    info = out.info[i] if i < len(out.info) and isinstance(out.info[i], dict) else {}
    if info.get("reason"):
        return str(info["reason"])
    return "a non-finite value" if not torch.isfinite(value[i]) else "marked invalid (no reason in its info)"


class RewardTimeout(Exception):
    """A reward call that did not return within its ``timeout_s``."""


#: how often a wait for a reward looks whether SIGTERM asked it to give up (seconds)
_POLL_S = 0.05


class TimeLimited:
    """``reward`` whose calls are abandoned after ``timeout_s`` seconds (raising :class:`RewardTimeout`).

    Each call runs in a daemon thread (it cannot hold up the process's exit), under the caller's grad
    mode and CUDA device. A thread cannot be stopped: an abandoned call runs on until it returns, and while
    it does, new calls raise :class:`RewardTimeout` at once instead of starting a second one beside it.
    The wait also gives up, raising :class:`flowalign.signals.Abandoned`, when SIGTERM asks it to
    (:func:`flowalign.signals.should_abandon`). Every other attribute (``name``, ``differentiable``,
    ``requires_metadata``, ...) is the reward's.
    """

    def __init__(self, name: str, reward: Reward, timeout_s: float):
        self._name, self._reward, self._timeout_s = name, reward, float(timeout_s)
        self._abandoned: threading.Thread | None = None

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("_"):  # own state not set yet (copy, pickle): no recursion into _reward
            raise AttributeError(attr)
        return getattr(self._reward, attr)

    def __call__(self, samples: torch.Tensor, prompts: list[str], metadata: list[dict[str, Any]]) -> Any:
        if should_abandon():
            raise Abandoned(self._name)
        if self._abandoned is not None and self._abandoned.is_alive():
            raise RewardTimeout(f"was not called: its previous call, abandoned after timeout_s={self._timeout_s:g} s, "
                                "is still running")
        result: dict[str, Any] = {}
        grad = torch.is_grad_enabled()
        # the CUDA device is per thread: a rank's reward works on the rank's device, not on cuda:0
        device = torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else None

        def work() -> None:
            try:
                if device is not None:
                    torch.cuda.set_device(device)
                with torch.set_grad_enabled(grad):
                    result["out"] = self._reward(samples, prompts, metadata)
            except BaseException as e:  # handed to the caller, which decides what it means
                result["error"] = e

        thread = threading.Thread(target=work, name=f"reward-{self._name}", daemon=True)
        thread.start()
        deadline = time.monotonic() + self._timeout_s
        # in slices: a SIGTERM (its handler runs on the main thread) is seen within one, wherever this waits
        while thread.is_alive() and (left := deadline - time.monotonic()) > 0:
            thread.join(min(left, _POLL_S))
            if thread.is_alive() and should_abandon():
                self._abandoned = thread
                raise Abandoned(self._name)
        if thread.is_alive():
            self._abandoned = thread
            raise RewardTimeout(f"gave no answer within timeout_s={self._timeout_s:g} s (the call is abandoned; "
                                "raise the reward's timeout_s if it is just slow)")
        if "error" in result:
            raise result["error"]
        return result["out"]


def time_limited(name: str, reward: Reward, timeout_s: float | None = None) -> Reward:
    """``reward`` under :class:`TimeLimited` (``timeout_s`` None: the default deadline,
    :data:`flowalign.config.REWARD_TIMEOUT_S`); a reward already under one is returned as it is."""
    from flowalign.config import REWARD_TIMEOUT_S

    if isinstance(reward, TimeLimited):
        return reward
    return TimeLimited(name, reward, REWARD_TIMEOUT_S if timeout_s is None else timeout_s)


def load_rewards(specs: Iterable[Any], weighted: bool = True) -> RewardSet:
    """The rewards of ``specs`` (:class:`flowalign.config.RewardSpec` objects), each loaded from the reward
    registry under its key, scoring through an mp4 file where it has a ``video_mp4_fps``
    (:class:`flowalign.video_file.Mp4RoundTrip`), under its ``timeout_s``, with its weight (each 1 where not
    ``weighted``) and its ``invalid_value``."""
    from flowalign.plugins import load_reward
    from flowalign.video_file import Mp4RoundTrip

    def built(spec: Any) -> Reward:
        reward = load_reward(spec.name, **spec.options)
        return reward if spec.video_mp4_fps is None else Mp4RoundTrip(reward, spec.video_mp4_fps)

    specs = list(specs)
    return RewardSet([(s.key, s.weight if weighted else 1.0, time_limited(s.key, built(s), s.timeout_s)) for s in specs],
                     invalid_values={s.key: s.invalid_value for s in specs if s.invalid_value is not None})


def load_panel(specs: Iterable[Any], where: str) -> RewardSet:
    """Rewards scored side by side (``evaluate --reward``, ``eval.rewards``), each under its name, or its
    ``label`` option when one is given (two variants of one reward need two labels); weights play no part.
    ``specs``: :class:`flowalign.config.RewardSpec` objects; ``where`` names the option in errors."""
    from flowalign.config import check_reward_keys

    specs = list(specs)
    check_reward_keys(specs, where)
    return load_rewards(specs, weighted=False)


def check_panel(specs: Iterable[Any], where: str) -> None:
    """:func:`load_panel`'s refusals (unknown rewards, options, repeated names) without building a reward."""
    import rewards
    from flowalign.config import check_reward_keys

    specs = list(specs)
    check_reward_keys(specs, where)
    for spec in specs:
        rewards.check(spec.name, **spec.options)
