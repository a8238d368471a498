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
"""

from __future__ import annotations

import json
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
    for that head, 0 leaves it out); None: every pair orders the first head, chosen first."""

    prompts: list[str]
    chosen: torch.Tensor
    rejected: torch.Tensor
    margin: torch.Tensor | None = None
    head_margins: dict[str, torch.Tensor] | None = None

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

    def select(self, idx: Sequence[int] | torch.Tensor) -> "PreferencePairs":
        i = torch.as_tensor(idx, dtype=torch.long).flatten()
        heads = None if self.head_margins is None else {h: m[i] for h, m in self.head_margins.items()}
        return PreferencePairs([self.prompts[j] for j in i.tolist()], self.chosen[i], self.rejected[i], self.margin[i],
                               heads)

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
        return PreferencePairs([p for x in parts for p in x.prompts], torch.cat([x.chosen for x in parts]),
                               torch.cat([x.rejected for x in parts]), torch.cat([x.margin for x in parts]), heads)

    def save(self, path: str | Path) -> None:
        from safetensors.torch import save_file

        tensors = {"chosen": self.chosen.float().contiguous(), "rejected": self.rejected.float().contiguous(),
                   "margin": self.margin.float().contiguous(),
                   **{f"margin.{h}": m.float().contiguous() for h, m in (self.head_margins or {}).items()}}
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
                       None if heads is None else {h: f.get_tensor(f"margin.{h}") for h in heads})


def bradley_terry_loss(r_chosen: torch.Tensor, r_rejected: torch.Tensor) -> torch.Tensor:
    """``mean -log σ(r_w - r_l)`` over pairs (scalar)."""
    return F.softplus(-(r_chosen - r_rejected)).mean()


def thurstone_loss(r_chosen: torch.Tensor, r_rejected: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """The authors' register loss on pairs (Guanys-dar/latent-reward-register ``losses.py``,
    ``dina_thurstone_loss`` on groups of two): ``mean 1 − sqrt(max(Φ((r_w − r_l)/sqrt(2v + 1e-6)), 1e-6))``,
    ``v = 2σ² + 0.05``, so a pair disagreeing at high noise costs less. ``(N,)`` each; scalar."""
    variance = 2.0 * sigma.to(r_chosen) ** 2 + 0.05
    margin = (r_chosen - r_rejected) / torch.sqrt(2 * variance + 1e-6)
    probability = torch.distributions.Normal(0.0, 1.0).cdf(margin)
    return (1.0 - torch.sqrt(probability.clamp_min(1e-6))).mean()


#: the pair losses ``fit`` can train with: name → ``loss(r_w, r_l, σ)``
PAIR_LOSSES: dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "bradley_terry": lambda r_w, r_l, sigma: bradley_terry_loss(r_w, r_l),
    "thurstone": thurstone_loss,
}


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


def _draw(pairs: PreferencePairs, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    sigma = torch.rand(len(pairs), generator=generator)
    noise = torch.randn(pairs.chosen.shape, generator=generator)
    return sigma, noise


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
               previous: dict[str, torch.Tensor] | None = None, loss_name: str = "bradley_terry"
               ) -> tuple[torch.Tensor, dict[str, float]]:
    """``L(real) + μ·L(generated) + anchor·mean (r_ψ − r_ψ,prev)²`` on the real batch (CoRe's L_RM; the
    plain pair loss on real pairs when ``generated`` is None and ``anchor`` is 0). ``L``: ``loss_name`` of
    :data:`PAIR_LOSSES` (Bradley-Terry, or the authors' Thurstone loss), per head over the pairs ordering it
    and averaged over heads (:func:`head_pair_loss`); the anchor holds the first head's score. The logs keep
    the ``bt_`` names."""
    if loss_name not in PAIR_LOSSES:
        raise UserError(f"pair loss {loss_name!r}: use one of {', '.join(PAIR_LOSSES)}")
    pair_loss = PAIR_LOSSES[loss_name]
    heads = reward_heads(reward)
    sigma, noise = _draw(real, generator)
    cond = encode(real.prompts)
    scores = noised_head_scores(reward, real, cond, sigma, noise)
    loss, acc = head_pair_loss(pair_loss, scores, real.directions(heads), sigma)
    r_w, r_l = scores[heads[0]]
    info = {"bt_real": loss.item(), "acc_real": acc}
    if generated is not None and len(generated) and mu > 0:
        gs, gn = _draw(generated, generator)
        g_scores = noised_head_scores(reward, generated, encode(generated.prompts), gs, gn)
        bt_gen, g_acc = head_pair_loss(pair_loss, g_scores, generated.directions(heads), gs)
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


def fit(reward: Any, pairs: PreferencePairs, encode: Encode, *, steps: int, batch_size: int = 32, lr: float = 1e-3,
        seed: int = 0, generated: PreferencePairs | None = None, mu: float = 0.5, anchor: float = 0.0,
        start_step: int = 0, optimizer: torch.optim.Optimizer | None = None,
        on_step: Callable[[int, dict[str, float]], None] | None = None, loss: str = "bradley_terry") -> dict[str, float]:
    """Adam on the reward's parameters for ``steps`` minibatches (real pairs, plus generated pairs and
    the anchor to the starting parameters when given), with the pair loss ``loss`` (:data:`PAIR_LOSSES`). Minibatches and noise are functions of
    ``(seed, step)``, so a fit resumed at ``start_step`` draws what an uninterrupted one would."""
    if len(pairs) == 0:
        raise UserError("no preference pairs to train on: generate more samples (--n, --group-size) or give a pairs file")
    params = [p for p in reward.parameters() if p.requires_grad]
    opt = optimizer or torch.optim.Adam(params, lr=lr)
    previous = {k: v.detach().clone() for k, v in reward.named_parameters()} if anchor > 0 else None
    stats: dict[str, list[float]] = {}
    for step in range(start_step, steps):
        gen = torch.Generator().manual_seed(int(np.random.SeedSequence([seed, step]).generate_state(1)[0]))
        idx = torch.randperm(len(pairs), generator=gen)[:batch_size]
        gen_part = None
        if generated is not None and len(generated):
            gen_part = generated.select(torch.randperm(len(generated), generator=gen)[:batch_size])
        total, info = refit_loss(reward, pairs.select(idx), encode, gen, generated=gen_part, mu=mu, anchor=anchor,
                                 previous=previous, loss_name=loss)
        opt.zero_grad(set_to_none=True)
        total.backward()
        opt.step()
        info["loss"] = total.item()
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
    keep every within-prompt pair whose scores differ by more than ``min_margin`` (chosen = higher).

    ``reward`` a dict ``{head: reward}``: one labeller per head of a several-head latent reward; the first
    orders the pairs as above, and a pair it ties is kept (its members in sampling order) when another head's
    scores differ; each pair carries every head's score difference (``head_margins``, 0 where a head's
    scores differ by ``min_margin`` or less or a side is invalid)."""
    from tqdm.auto import tqdm

    from flowalign.sampling import rollout

    labellers = reward if isinstance(reward, dict) else {"": reward}
    steps = int(num_steps or policy.defaults.get("num_steps", 20))
    chosen, rejected, pair_prompts, margins, scores_all = [], [], [], [], []
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
    return PreferencePairs(pair_prompts, torch.stack(chosen), torch.stack(rejected), torch.tensor(margins), heads), info
