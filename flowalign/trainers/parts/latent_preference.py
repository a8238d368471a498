"""Preference pairs for latent rewards and the Bradley-Terry fit (``docs/methods/latent_registers.md``).

A pair is (prompt, x0_w, x0_l): the clean latents of a chosen and a rejected sample. Training noises
both with ONE shared ε at a σ ~ U(0,1) per pair, ``x_σ = (1-σ)·x0 + σ·ε``, and minimises
``-log σ(r(x_σ^w) - r(x_σ^l))`` (or, ``loss="thurstone"``, the authors' Thurstone loss on the pair);
sharing ε makes the difference depend on the samples, not the noise.
Model- and reward-agnostic: a reward is any :class:`~flowalign.protocols.LatentReward` that is also a
``torch.nn.Module`` whose parameters are the trainable part; prompts are encoded by a callable.

Several heads (a reward with ``head_names`` and ``score_heads``, one head per preference signal, as the
authors' registers): a pair carries each head's label difference (``head_margins``; 0: that head does not
order the pair), and the loss is their ``multihead_group_loss`` on pairs: each head's pair loss over the
pairs it orders, in its own direction, averaged over the heads (a head that orders no pair of the batch
adds 0 and still counts). Pairs without head margins order the first head only.

Two forms of a training batch (``batch_form``). ``"pairs"``: a batch is ``batch_size`` random pairs, each with
its own σ ~ U(0, 1) and ε, the pair loss averaged over pairs. ``"authors"``: the register authors' (their
``training.py`` ``_noise_batch`` and ``losses.py`` ``multihead_group_loss``): a batch is ``batch_size`` groups
(the pairs one prompt's samples form, ``PreferencePairs.group``; a pair without a group is its own), one σ per
group read from the scheduler's 1000-level training grid at u ~ U(0, 1) (:func:`authors_sigma`), one ε shared by
the whole group, each head's loss averaged over a group's pairs, then over the groups, and the heads' losses
summed. Their epochs over the data and gradient accumulation to a global batch are :func:`authors_steps`.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from flowalign.errors import UserError
from flowalign.io import atomic_path
from flowalign.protocols import Conditioning, FlowPolicy, Reward

Encode = Callable[[list[str]], Conditioning]
#: σ bins of the accuracy report (the method page's "per σ bin"); each pair is scored at every bin's centre
DEFAULT_BINS = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)


@dataclass
class PreferencePairs:
    """``chosen`` / ``rejected`` clean latents ``(N, ...)`` float32 and their ``prompts`` (N). ``margin``
    ``(N,)``: the labelling reward's score difference (informative only). ``head_margins``: for a
    several-head reward, each head's label difference chosen − rejected ``(N,)`` (its sign orders the pair
    for that head, 0 leaves it out); None: every pair orders the first head, chosen first. ``group`` ``(N,)``
    int64: the group of samples (one prompt's) each pair was formed from, the unit of the authors' batches;
    None: every pair is its own group."""

    prompts: list[str]
    chosen: torch.Tensor
    rejected: torch.Tensor
    margin: torch.Tensor | None = None
    head_margins: dict[str, torch.Tensor] | None = None
    group: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if not (len(self.prompts) == self.chosen.shape[0] == self.rejected.shape[0]):
            raise UserError(f"preference pairs: {len(self.prompts)} prompts, {self.chosen.shape[0]} chosen and "
                            f"{self.rejected.shape[0]} rejected latents; give one of each per pair")
        if self.chosen.shape != self.rejected.shape:
            raise UserError(f"chosen latents {tuple(self.chosen.shape)} and rejected {tuple(self.rejected.shape)} differ in shape")
        if self.margin is None:
            self.margin = torch.zeros(len(self.prompts))
        for head, m in (self.head_margins or {}).items():
            if m.shape != (len(self.prompts),):
                raise UserError(f"preference pairs: head {head!r} has {tuple(m.shape)} margins for {len(self.prompts)} pairs")
        if self.group is not None:
            if self.group.shape != (len(self.prompts),):
                raise UserError(f"preference pairs: {tuple(self.group.shape)} group ids for {len(self.prompts)} pairs")
            self.group = self.group.long()

    def __len__(self) -> int:
        return len(self.prompts)

    @property
    def heads(self) -> list[str] | None:
        """The heads the pairs label (None: the first head of whatever reward trains on them)."""
        return None if self.head_margins is None else list(self.head_margins)

    def directions(self, heads: Sequence[str]) -> dict[str, torch.Tensor]:
        """Per head of a reward with ``heads``, ``(N,)`` in {−1, 0, 1}: the order the pair gives that head
        (+1: chosen above rejected; 0: the head is not ordered by the pair)."""
        if self.head_margins is None:
            ones = torch.ones(len(self))
            return {h: ones if i == 0 else torch.zeros(len(self)) for i, h in enumerate(heads)}
        if set(self.head_margins) != set(heads):
            raise UserError(f"the pairs label heads {list(self.head_margins)} but the reward's heads are {list(heads)}; "
                            "train a reward with the pairs' heads")
        return {h: torch.sign(self.head_margins[h].float()) for h in heads}

    def group_ids(self) -> torch.Tensor:
        """``(N,)`` int64: each pair's group (``group``, or every pair its own when there is none)."""
        return self.group if self.group is not None else torch.arange(len(self))

    def groups(self) -> list[list[int]]:
        """The pairs of each group, groups in order of their first pair."""
        members: dict[int, list[int]] = {}
        for i, g in enumerate(self.group_ids().tolist()):
            members.setdefault(g, []).append(i)
        return list(members.values())

    def select(self, idx: Sequence[int] | torch.Tensor) -> "PreferencePairs":
        i = torch.as_tensor(idx, dtype=torch.long).flatten()
        heads = None if self.head_margins is None else {h: m[i] for h, m in self.head_margins.items()}
        return PreferencePairs([self.prompts[j] for j in i.tolist()], self.chosen[i], self.rejected[i], self.margin[i],
                               heads, None if self.group is None else self.group[i])

    def split(self, test_fraction: float, seed: int = 0) -> tuple["PreferencePairs", "PreferencePairs"]:
        """Train / test by prompt (a prompt's pairs never straddle the split)."""
        prompts = sorted(set(self.prompts))
        rng = np.random.default_rng(seed)
        rng.shuffle(prompts)
        n_test = max(1, int(round(test_fraction * len(prompts)))) if test_fraction > 0 else 0
        test = set(prompts[:n_test])
        tr = [i for i, p in enumerate(self.prompts) if p not in test]
        te = [i for i, p in enumerate(self.prompts) if p in test]
        return self.select(tr), self.select(te)

    @staticmethod
    def cat(parts: list["PreferencePairs"]) -> "PreferencePairs":
        labels = {tuple(x.heads) if x.heads is not None else None for x in parts}
        if len(labels) > 1:
            raise UserError(f"pair files label different heads ({sorted(map(str, labels))}); merge files of one kind")
        heads = None if parts[0].head_margins is None else {
            h: torch.cat([x.head_margins[h] for x in parts]) for h in parts[0].head_margins}
        group = None
        if any(x.group is not None for x in parts):  # each file's groups stay apart: ids offset past the last
            ids, offset = [], 0
            for x in parts:
                g = x.group_ids()
                if len(g):
                    ids.append(g - g.min() + offset)
                    offset = int(ids[-1].max()) + 1
            group = torch.cat(ids) if ids else torch.zeros(0, dtype=torch.long)
        return PreferencePairs([p for x in parts for p in x.prompts], torch.cat([x.chosen for x in parts]),
                               torch.cat([x.rejected for x in parts]), torch.cat([x.margin for x in parts]), heads,
                               group)

    def save(self, path: str | Path) -> None:
        from safetensors.torch import save_file

        tensors = {"chosen": self.chosen.float().contiguous(), "rejected": self.rejected.float().contiguous(),
                   "margin": self.margin.float().contiguous(),
                   **{f"margin.{h}": m.float().contiguous() for h, m in (self.head_margins or {}).items()},
                   **({} if self.group is None else {"group": self.group.long().contiguous()})}
        metadata = {"prompts": json.dumps(self.prompts)}
        if self.head_margins is not None:
            metadata["heads"] = json.dumps(list(self.head_margins))
        with atomic_path(path) as tmp:
            save_file(tensors, str(tmp), metadata=metadata)

    @classmethod
    def load(cls, path: str | Path) -> "PreferencePairs":
        from safetensors import safe_open

        path = Path(path)
        if not path.is_file():
            raise UserError(f"{path}: no such pairs file; write one with `flowalign train-reward --save-pairs`")
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
            prompts = json.loads(meta.get("prompts", "null") or "null")
            if prompts is None:
                raise UserError(f"{path} is not a preference-pairs file (no prompts in its metadata)")
            heads = json.loads(meta["heads"]) if "heads" in meta else None
            return cls(prompts, f.get_tensor("chosen"), f.get_tensor("rejected"), f.get_tensor("margin"),
                       None if heads is None else {h: f.get_tensor(f"margin.{h}") for h in heads},
                       f.get_tensor("group") if "group" in f.keys() else None)


def bradley_terry_terms(r_chosen: torch.Tensor, r_rejected: torch.Tensor, sigma: torch.Tensor | None = None) -> torch.Tensor:
    """``-log σ(r_w - r_l)`` per pair ``(N,)`` (σ unused)."""
    return F.softplus(-(r_chosen - r_rejected))


def bradley_terry_loss(r_chosen: torch.Tensor, r_rejected: torch.Tensor) -> torch.Tensor:
    """``mean -log σ(r_w - r_l)`` over pairs (scalar)."""
    return bradley_terry_terms(r_chosen, r_rejected).mean()


def thurstone_terms(r_chosen: torch.Tensor, r_rejected: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """The authors' Thurstone term per pair ``(N,)``: ``1 − sqrt(max(Φ((r_w − r_l)/sqrt(2v + 1e-6)), 1e-6))``,
    ``v = 2σ² + 0.05`` (both sides share σ)."""
    variance = 2.0 * sigma.to(r_chosen) ** 2 + 0.05
    margin = (r_chosen - r_rejected) / torch.sqrt(2 * variance + 1e-6)
    probability = torch.distributions.Normal(0.0, 1.0).cdf(margin)
    return 1.0 - torch.sqrt(probability.clamp_min(1e-6))


def thurstone_loss(r_chosen: torch.Tensor, r_rejected: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """The authors' register loss on pairs (Guanys-dar/latent-reward-register ``losses.py``,
    ``dina_thurstone_loss`` on groups of two): the mean of :func:`thurstone_terms`, so a pair disagreeing at
    high noise costs less. ``(N,)`` each; scalar."""
    return thurstone_terms(r_chosen, r_rejected, sigma).mean()


#: the pair losses ``fit`` can train with: name → ``loss(r_w, r_l, σ)``
PAIR_LOSSES: dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "bradley_terry": lambda r_w, r_l, sigma: bradley_terry_loss(r_w, r_l),
    "thurstone": thurstone_loss,
}
#: the same losses per pair, ``(N,)``: name → ``terms(r_w, r_l, σ)``
PAIR_LOSS_TERMS: dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "bradley_terry": bradley_terry_terms,
    "thurstone": thurstone_terms,
}
#: the forms of a training batch (module docstring): random pairs, or the authors' groups
BATCH_FORMS = ("pairs", "authors")
#: the static shift their FLUX registers train at, e^1.15 (FLUX.1's max_shift: the 1024-px value of its
#: dynamic shift, pinned by their ``flux_utils.SCHEDULER_SHIFT``)
AUTHORS_DYNAMIC_SHIFT_MU = 1.15


def authors_grid(policy: Any) -> torch.Tensor:
    """``(T,)`` float32 the noise levels the authors' register training draws from: the policy's scheduler
    training grid (:func:`~flowalign.trainers.parts.training_grid.training_grid`: SD3's shift 3.0), except that
    a scheduler which shifts dynamically (FLUX) is pinned at the static shift ``e^max_shift`` (their
    ``flux_scheduler_config``: e^1.15 for FLUX.1)."""
    from flowalign.trainers.parts.training_grid import training_grid

    scheduler = getattr(policy, "scheduler", None)
    config = dict(getattr(scheduler, "config", {}) or {})
    if not config.get("use_dynamic_shifting", False):
        return training_grid(policy)
    levels = int(config.get("num_train_timesteps", 1000))
    shift = math.exp(float(config.get("max_shift", AUTHORS_DYNAMIC_SHIFT_MU)))
    s = torch.from_numpy(np.linspace(1, levels, levels, dtype=np.float32)[::-1].copy()) / levels
    return shift * s / (1 + (shift - 1) * s)


def authors_sigma(u: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """Their training noise level for uniforms ``u (B,)`` in [0, 1) (``sample_timesteps`` with the ``uniform``
    weighting): grid level ``min(floor(T·u), T − 1)`` of ``grid (T,)`` (1 → σ(1/T)), so ``u < 1/T`` is pure
    noise and the cleanest level is σ(1/T), never 0. The register reads timestep ``T·σ`` (SD3: 1000·σ).
    ``(B,)`` in the grid's dtype."""
    levels = grid.shape[0]
    index = (u.float() * levels).long().clamp(0, levels - 1)
    return grid.to(u.device)[index]


def noised_scores(reward: Any, pairs: PreferencePairs, cond: Conditioning, sigma: torch.Tensor, noise: torch.Tensor,
                  scorer: Callable[..., torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores ``(N,)`` of both sides noised with ONE shared ε: ``x_σ = (1-σ)·x0 + σ·ε`` per pair.

    ``sigma (N,)``, ``noise`` like ``pairs.chosen``. Both sides go through the reward as one batch.
    ``scorer(x, σ, cond)`` replaces ``reward.score`` (e.g. the reward under other parameters)."""
    device = next(reward.parameters()).device
    s = sigma.float().to(device).view(-1, *([1] * (pairs.chosen.ndim - 1)))
    eps = noise.to(device)
    x_w = (1 - s) * pairs.chosen.to(device) + s * eps
    x_l = (1 - s) * pairs.rejected.to(device) + s * eps
    score = scorer or reward.score
    both = score(torch.cat([x_w, x_l]), torch.cat([sigma, sigma]).to(device), Conditioning.cat([cond, cond]))
    if isinstance(both, dict):  # a several-head scorer: each head's pair of sides
        return {h: tuple(t.chunk(2)) for h, t in both.items()}
    return both.chunk(2)


def reward_heads(reward: Any) -> list[str]:
    """The heads of ``reward`` (its ``head_names``), or ``["score"]`` for a one-score reward."""
    return list(getattr(reward, "head_names", None) or ["score"])


def noised_head_scores(reward: Any, pairs: PreferencePairs, cond: Conditioning, sigma: torch.Tensor,
                       noise: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per head, the scores ``(N,)`` of both sides, noised as :func:`noised_scores` (one DiT pass for every
    head of a several-head reward, its ``score_heads``)."""
    if not hasattr(reward, "score_heads"):
        return {reward_heads(reward)[0]: noised_scores(reward, pairs, cond, sigma, noise)}
    return noised_scores(reward, pairs, cond, sigma, noise, scorer=reward.score_heads)


def head_pair_loss(pair_loss: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
                   scores: dict[str, tuple[torch.Tensor, torch.Tensor]], directions: dict[str, torch.Tensor],
                   sigma: torch.Tensor) -> tuple[torch.Tensor, float]:
    """The authors' ``multihead_group_loss`` on pairs (equal head weights): each head's pair loss over the
    pairs that order it, in its direction; the mean over heads (a head with no such pair adds 0). And the
    fraction of (head, pair) orders the scores get right."""
    total, right, count = 0.0, 0.0, 0
    for head, (r_w, r_l) in scores.items():
        d = directions[head].to(r_w)
        m = d != 0
        if m.any():
            total = total + pair_loss(d[m] * r_w[m], d[m] * r_l[m], sigma.to(r_w.device)[m])
            right += (d[m] * (r_w[m] - r_l[m]) > 0).float().sum().item()
            count += int(m.sum())
    loss = total / len(scores) if torch.is_tensor(total) else next(iter(scores.values()))[0].sum() * 0.0
    return loss, right / max(count, 1)


def group_head_loss(loss_name: str, scores: dict[str, tuple[torch.Tensor, torch.Tensor]],
                    directions: dict[str, torch.Tensor], sigma: torch.Tensor, group: torch.Tensor) -> tuple[torch.Tensor, float]:
    """The authors' ``multihead_group_loss`` (``losses.py`` @ f251e52, equal head weights) on a batch of groups
    given as their pairs: per head, the ``loss_name`` term (:data:`PAIR_LOSS_TERMS`) of each pair that orders it,
    in its direction, averaged within each group (``group (N,)``), then over the groups holding such a pair; the
    heads' losses summed (a head no pair orders adds 0). ``scores``: per head ``(r_w, r_l)`` ``(N,)`` each; also
    the fraction of (head, pair) orders the scores get right."""
    terms_of = PAIR_LOSS_TERMS[loss_name]
    total, right, count = 0.0, 0.0, 0
    for head, (r_w, r_l) in scores.items():
        d = directions[head].to(r_w)
        m = d != 0
        if not m.any():
            continue
        terms = terms_of(d[m] * r_w[m], d[m] * r_l[m], sigma.to(r_w.device)[m])
        _, members = torch.unique(group.to(r_w.device)[m], return_inverse=True)
        per_group = torch.zeros(int(members.max()) + 1, dtype=terms.dtype, device=terms.device).index_add(0, members, terms)
        per_group = per_group / torch.bincount(members).to(terms.dtype)
        total = total + per_group.mean()
        right += (d[m] * (r_w[m] - r_l[m]) > 0).float().sum().item()
        count += int(m.sum())
    loss = total if torch.is_tensor(total) else next(iter(scores.values()))[0].sum() * 0.0
    return loss, right / max(count, 1)


def draw_noise(pairs: PreferencePairs, generator: torch.Generator, batch_form: str = "pairs",
          grid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``σ (N,)`` and ε like ``pairs.chosen`` for a batch. ``pairs``: σ ~ U(0, 1) and ε per pair. ``authors``: one
    uniform and one ε per group (groups in order of their first pair, as their batch holds them), σ read from
    ``grid`` (:func:`authors_sigma`) and both shared by every pair of the group, so a group's samples are all
    noised alike: the draw order (the uniforms, then ε) is theirs, so a CPU generator seeded as their global
    RNG draws their σ and ε."""
    if batch_form == "pairs":
        sigma = torch.rand(len(pairs), generator=generator)
        noise = torch.randn(pairs.chosen.shape, generator=generator)
        return sigma, noise
    if grid is None:
        raise ValueError("the authors' batch form needs the scheduler's training grid (authors_grid)")
    first: dict[int, int] = {}
    member = torch.tensor([first.setdefault(g, len(first)) for g in pairs.group_ids().tolist()], dtype=torch.long)
    u = torch.rand(len(first), generator=generator)
    noise = torch.randn((len(first), *pairs.chosen.shape[1:]), generator=generator)
    return authors_sigma(u, grid)[member], noise[member]


def pairwise_accuracy(reward: Any, pairs: PreferencePairs, encode: Encode, *, bins: Sequence[float] = DEFAULT_BINS,
                      seed: int = 0, batch_size: int = 32) -> dict[str, float]:
    """Fraction of pairs with ``r(x_σ^w) > r(x_σ^l)`` at σ = 0 and at each bin's centre (shared ε, fixed seed).

    Keys ``"sigma=0.00"``, ``"sigma=0.10"``, ...; ties count half. A several-head reward: the same per head,
    ``{head: {...}}``, each over the pairs that order that head, in its direction."""
    points = [0.0] + [round((a + b) / 2, 4) for a, b in zip(bins[:-1], bins[1:])]
    heads = reward_heads(reward)
    directions = pairs.directions(heads)
    gen = torch.Generator().manual_seed(seed)
    noise = torch.randn(pairs.chosen.shape, generator=gen)
    out: dict[str, dict[str, float]] = {h: {} for h in heads}
    with torch.no_grad():
        for sigma in points:
            correct = dict.fromkeys(heads, 0.0)
            for start in range(0, len(pairs), batch_size):
                idx = list(range(start, min(start + batch_size, len(pairs))))
                part = pairs.select(idx)
                scores = noised_head_scores(reward, part, encode(part.prompts), torch.full((len(idx),), sigma), noise[idx])
                for h, (r_w, r_l) in scores.items():
                    margin = directions[h][idx].to(r_w) * (r_w - r_l)
                    ordered = directions[h][idx].to(r_w) != 0
                    correct[h] += ((margin > 0) & ordered).float().sum().item() + 0.5 * ((margin == 0) & ordered).float().sum().item()
            for h in heads:
                out[h][f"sigma={sigma:.2f}"] = correct[h] / max(1, int((directions[h] != 0).sum()))
    return out[heads[0]] if len(heads) == 1 else out


def refit_loss(reward: Any, real: PreferencePairs, encode: Encode, generator: torch.Generator, *,
               generated: PreferencePairs | None = None, mu: float = 0.5, anchor: float = 0.0,
               previous: dict[str, torch.Tensor] | None = None, loss_name: str = "bradley_terry",
               batch_form: str = "pairs", grid: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """``L(real) + μ·L(generated) + anchor·mean (r_ψ − r_ψ,prev)²`` on the real batch (CoRe's L_RM; the
    plain pair loss on real pairs when ``generated`` is None and ``anchor`` is 0). ``L``: ``loss_name`` of
    :data:`PAIR_LOSSES` (Bradley-Terry, or the authors' Thurstone loss), per head over the pairs ordering it
    and averaged over heads (:func:`head_pair_loss`); with ``batch_form="authors"`` the batch is noised per
    group from ``grid`` and the loss is theirs over groups (:func:`group_head_loss`). The anchor holds the
    first head's score. The logs keep the ``bt_`` names."""
    if loss_name not in PAIR_LOSSES:
        raise UserError(f"pair loss {loss_name!r}: use one of {', '.join(PAIR_LOSSES)}")
    if batch_form not in BATCH_FORMS:
        raise UserError(f"batch form {batch_form!r}: use one of {', '.join(BATCH_FORMS)}")
    pair_loss = PAIR_LOSSES[loss_name]

    def batch_loss(part: PreferencePairs, scores: dict, sigma: torch.Tensor) -> tuple[torch.Tensor, float]:
        if batch_form == "authors":
            return group_head_loss(loss_name, scores, part.directions(heads), sigma, part.group_ids())
        return head_pair_loss(pair_loss, scores, part.directions(heads), sigma)

    heads = reward_heads(reward)
    sigma, noise = draw_noise(real, generator, batch_form, grid)
    cond = encode(real.prompts)
    scores = noised_head_scores(reward, real, cond, sigma, noise)
    loss, acc = batch_loss(real, scores, sigma)
    r_w, r_l = scores[heads[0]]
    info = {"bt_real": loss.item(), "acc_real": acc}
    if generated is not None and len(generated) and mu > 0:
        gs, gn = draw_noise(generated, generator, batch_form, grid)
        g_scores = noised_head_scores(reward, generated, encode(generated.prompts), gs, gn)
        bt_gen, g_acc = batch_loss(generated, g_scores, gs)
        loss = loss + mu * bt_gen
        info.update(bt_generated=bt_gen.item(), acc_generated=g_acc)
    if anchor > 0 and previous is not None:
        from torch.func import functional_call

        with torch.no_grad():
            p_w, p_l = noised_scores(reward, real, cond, sigma, noise,
                                     scorer=lambda x, s, c: functional_call(reward, previous, (x, s, c)))
        drift = ((r_w - p_w) ** 2 + (r_l - p_l) ** 2).mean() / 2
        loss = loss + anchor * drift
        info["anchor"] = drift.item()
    return loss, info


def authors_steps(units: int, *, epochs: int, batch_size: int, global_batch: int | None = None,
                  seed: int = 42) -> list[list[list[int]]]:
    """The authors' epochs as optimiser steps: per step, its micro-batches of unit indices (pairs, or groups).

    As their DiNa-pair loop (``dataset.py`` ``iter_dina_pair_batches``, ``runtime.py``, ``training.py`` @
    f251e52): epoch ``e`` visits the units in the order ``random.Random(seed + e).shuffle``, in micro-batches
    of ``batch_size`` (an incomplete last one dropped); ``global_batch / batch_size`` micro-batches make one
    optimiser step, and an epoch's leftover micro-batches one more (their gradient, rescaled by the
    accumulation count over the leftover count, is the mean over those micro-batches: every step's gradient
    is the mean of its micro-batches' losses'). Their paper preset: 3 epochs, micro-batches of 8 pairs,
    global batch 64, seed 42."""
    global_batch = batch_size if global_batch is None else global_batch
    if batch_size < 1 or global_batch < batch_size or global_batch % batch_size:
        raise UserError(f"global batch {global_batch}: give a positive multiple of the batch size {batch_size}")
    accumulate = global_batch // batch_size
    steps: list[list[list[int]]] = []
    for epoch in range(epochs):
        order = list(range(units))
        random.Random(seed + epoch).shuffle(order)
        micro = [order[i : i + batch_size] for i in range(0, units - batch_size + 1, batch_size)]
        steps += [micro[i : i + accumulate] for i in range(0, len(micro), accumulate)]
    return steps


def fit(reward: Any, pairs: PreferencePairs, encode: Encode, *, steps: int | None = None, batch_size: int = 32,
        lr: float = 1e-3, seed: int = 0, generated: PreferencePairs | None = None, mu: float = 0.5, anchor: float = 0.0,
        start_step: int = 0, optimizer: torch.optim.Optimizer | None = None,
        on_step: Callable[[int, dict[str, float]], None] | None = None, loss: str = "bradley_terry",
        batch_form: str = "pairs", grid: torch.Tensor | None = None,
        schedule: list[list[list[int]]] | None = None) -> dict[str, float]:
    """Adam on the reward's parameters for ``steps`` minibatches (real pairs, plus generated pairs and
    the anchor to the starting parameters when given), with the pair loss ``loss`` (:data:`PAIR_LOSSES`).

    The unit of a batch is a pair (``batch_form="pairs"``) or a group of pairs (``"authors"``, noised per group
    from ``grid``: :func:`refit_loss`). Without ``schedule`` each step is ``batch_size`` random units; with it
    (:func:`authors_steps`), step ``k`` runs ``schedule[k]``'s micro-batches, the gradient the mean of their
    losses', and ``steps`` is its length. Minibatches and noise are functions of ``(seed, step)``, so a fit
    resumed at ``start_step`` draws what an uninterrupted one would."""
    if len(pairs) == 0:
        raise UserError("no preference pairs to train on: generate more samples (--n, --group-size) or give a pairs file")
    units = [[i] for i in range(len(pairs))] if batch_form == "pairs" else pairs.groups()
    if schedule is not None:
        steps = len(schedule)
    if steps is None:
        raise ValueError("fit needs steps or a schedule")
    params = [p for p in reward.parameters() if p.requires_grad]
    opt = optimizer or torch.optim.Adam(params, lr=lr)
    previous = {k: v.detach().clone() for k, v in reward.named_parameters()} if anchor > 0 else None
    stats: dict[str, list[float]] = {}
    for step in range(start_step, steps):
        gen = torch.Generator().manual_seed(int(np.random.SeedSequence([seed, step]).generate_state(1)[0]))
        micro = schedule[step] if schedule is not None else [torch.randperm(len(units), generator=gen)[:batch_size].tolist()]
        opt.zero_grad(set_to_none=True)
        info: dict[str, float] = {}
        for chosen_units in micro:
            idx = [i for u in chosen_units for i in units[u]]
            gen_part = None
            if generated is not None and len(generated):
                gen_part = generated.select(torch.randperm(len(generated), generator=gen)[:batch_size])
            total, part = refit_loss(reward, pairs.select(idx), encode, gen, generated=gen_part, mu=mu, anchor=anchor,
                                     previous=previous, loss_name=loss, batch_form=batch_form, grid=grid)
            # the step's gradient is the mean of its micro-batches' (their loss / accumulation steps)
            (total / len(micro)).backward()
            part["loss"] = total.item()
            for k, v in part.items():
                info[k] = info.get(k, 0.0) + v / len(micro)
        opt.step()
        for k, v in info.items():
            stats.setdefault(k, []).append(v)
        if on_step is not None:
            on_step(step, info)
    return {k: float(np.mean(v)) for k, v in stats.items()}


@torch.no_grad()
def generate_pairs(policy: FlowPolicy, prompts: list[str], metadata: list[dict], reward: Reward | dict[str, Reward], *,
                   group_size: int = 4, num_steps: int | None = None, seed: int = 0, batch_size: int = 16,
                   min_margin: float = 1e-6, progress: bool = True) -> tuple[PreferencePairs, dict[str, float]]:
    """Sample ``group_size`` ODE samples per prompt (seeded per prompt), score them with ``reward`` and
    keep every within-prompt pair whose scores differ by more than ``min_margin`` (chosen = higher); each
    pair records its prompt's group (``group``: the prompt's index), the unit of the authors' batches.

    ``reward`` a dict ``{head: reward}``: one labeller per head of a several-head latent reward; the first
    orders the pairs as above, and a pair it ties is kept (its members in sampling order) when another head's
    scores differ; each pair carries every head's score difference (``head_margins``, 0 where a head's
    scores differ by ``min_margin`` or less or a side is invalid)."""
    from tqdm.auto import tqdm

    from flowalign.sampling import rollout

    labellers = reward if isinstance(reward, dict) else {"": reward}
    steps = int(num_steps or policy.defaults.get("num_steps", 20))
    chosen, rejected, pair_prompts, margins, scores_all, groups = [], [], [], [], [], []
    head_margins: dict[str, list[float]] = {h: [] for h in labellers}
    per_batch = max(1, batch_size // group_size)
    for start in tqdm(range(0, len(prompts), per_batch), desc="sampling pairs", unit="batch", disable=not progress):
        ps = prompts[start : start + per_batch]
        ms = metadata[start : start + per_batch]
        rep_p = [p for p in ps for _ in range(group_size)]
        rep_m = [m for m in ms for _ in range(group_size)]
        noise = torch.cat([policy.initial_noise(group_size, torch.Generator().manual_seed(seed * 1_000_003 + start + i))
                           for i in range(len(ps))])
        out = rollout(policy, rep_p, num_steps=steps, sampler="ode", initial_noise=noise, metadata=rep_m)
        totals = {}
        for head, labeller in labellers.items():
            scored = labeller(out.samples, rep_p, rep_m)
            totals[head] = torch.where(scored.valid, scored.total.float(), torch.full_like(scored.total.float(), float("nan")))
        total = next(iter(totals.values()))
        scores_all.append(total)
        x0 = out.final_latents.float().cpu()

        def difference(head: str, a: int, b: int) -> float:
            d = totals[head][a].item() - totals[head][b].item()
            return d if np.isfinite(d) and abs(d) > min_margin else 0.0

        for g in range(len(ps)):
            base = g * group_size
            for a in range(group_size):
                for b in range(group_size):
                    sa, sb = total[base + a].item(), total[base + b].item()
                    ordered = np.isfinite(sa) and np.isfinite(sb) and sa - sb > min_margin
                    tied = a < b and difference(next(iter(labellers)), base + a, base + b) == 0.0
                    if not ordered and not (tied and any(difference(h, base + a, base + b) for h in labellers)):
                        continue
                    chosen.append(x0[base + a])
                    rejected.append(x0[base + b])
                    pair_prompts.append(ps[g])
                    groups.append(start + g)
                    margins.append(sa - sb if ordered else 0.0)
                    for head in labellers:
                        head_margins[head].append(difference(head, base + a, base + b))
    scores = torch.cat(scores_all)
    info = {"samples": int(scores.numel()), "pairs": len(pair_prompts), "mean_score": float(np.nanmean(scores.numpy()))}
    if not pair_prompts:
        raise UserError(f"no two samples of any prompt scored differently ({info['samples']} samples): raise --group-size or --n")
    heads = None if not isinstance(reward, dict) else {h: torch.tensor(m) for h, m in head_margins.items()}
    if heads is not None:
        info.update({f"pairs_{h}": int((m != 0).sum()) for h, m in heads.items()})
    return PreferencePairs(pair_prompts, torch.stack(chosen), torch.stack(rejected), torch.tensor(margins), heads,
                           torch.tensor(groups, dtype=torch.long)), info
