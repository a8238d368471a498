"""Advantage strategies for group-sampled trainers (``docs/methods/flow_grpo.md``).

All take rewards of the whole gathered batch (every rank's samples) with a group id per sample and return
one advantage per sample. Selected by ``trainer.advantage``: ``group`` | ``global_std`` | ``per_reward`` |
``gdpo`` | ``win_rate`` | ``dual`` (PD-GRPO's pointwise and pairwise groups, mixed by ``pairwise_weight``).
"""

from __future__ import annotations

from typing import Callable, Literal

import torch

AdvantageKind = Literal["group", "global_std", "per_reward", "gdpo", "win_rate", "dual"]
ADVANTAGE_KINDS = ("group", "global_std", "per_reward", "gdpo", "win_rate", "dual")


def _group_mean_std(values: torch.Tensor, groups: torch.Tensor, unbiased: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample mean and std of its group: ``(N,)``, ``(N,)``; population std, or (``unbiased``) divided by
    n − 1, which a group of one sample leaves at 0 where torch's would be NaN."""
    _, inverse = torch.unique(groups.to(values.device), return_inverse=True)  # index_add_'s index: values' device
    count = torch.zeros(int(inverse.max()) + 1, dtype=values.dtype, device=values.device).index_add_(
        0, inverse, torch.ones_like(values))
    mean = torch.zeros_like(count).index_add_(0, inverse, values) / count
    squares = torch.zeros_like(count).index_add_(0, inverse, (values - mean[inverse]) ** 2)
    var = squares / ((count - 1).clamp(min=1) if unbiased else count)
    return mean[inverse], var.sqrt()[inverse]


def group_advantages(
    rewards: torch.Tensor, groups: torch.Tensor, *, std: Literal["group", "global"] = "group", eps: float = 1e-4,
    unbiased: bool = False,
) -> torch.Tensor:
    """Flow-GRPO: ``A_i = (R_i − mean_group R) / (std + eps)``, population std of the group or of the whole
    gathered batch (``global_std``, the SD3/FLUX default); ``unbiased``: the std divided by n − 1 (DanceGRPO's
    ``Tensor.std()``). Computed in float32, or float64 for float64 ``rewards``."""
    rewards = rewards.to(torch.promote_types(rewards.dtype, torch.float32))
    mean, group_std = _group_mean_std(rewards, groups, unbiased)
    scale = group_std if std == "group" else rewards.std(unbiased=unbiased).expand_as(rewards)
    return (rewards - mean) / (scale + eps)


def per_reward_advantages(components: torch.Tensor, weights: torch.Tensor, groups: torch.Tensor, *,
                          eps: float = 1e-4, unbiased: bool = False) -> torch.Tensor:
    """Each reward's group advantage, weight-summed: ``A = Σ_m w_m·(r^(m) − mean_g)/(std_g + eps)`` ``(N,)``
    from ``components`` ``(N, M)`` and ``weights`` ``(M,)`` (MixGRPO's ``advantage_aggr``; with one reward,
    the ``group`` advantage). Unlike :func:`gdpo_advantages` the sum is not renormalised over the batch."""
    per_reward = [group_advantages(components[:, m], groups, std="group", eps=eps, unbiased=unbiased)
                  for m in range(components.shape[1])]
    return torch.stack(per_reward, dim=1) @ weights.to(per_reward[0].dtype)


GDPOStd = Literal["floor", "unbiased", "population"]
GDPO_STDS = ("floor", "unbiased", "population")


def gdpo_advantages(
    components: torch.Tensor, weights: torch.Tensor, groups: torch.Tensor, *, std: GDPOStd = "floor",
    eps: float | None = None,
) -> torch.Tensor:
    """GDPO (arXiv 2601.05242): normalise each reward within its group, weight-sum, renormalise over the batch.

    ``components`` ``(N, M)`` raw rewards, ``weights`` ``(M,)`` as written (not divided by their sum).
    ``A^(m) = (r^(m) − mean_g)/s_g``, ``S = Σ_m w_m A^(m)``, ``Â = (S − mean_batch S)/s_batch``, where ``std``
    says what divides:

    - ``"floor"``: the population std floored, ``max(std, eps)`` with ``eps`` 1e-6 (Flow-Factory's
      ``AdvantageProcessor.compute_gdpo``, which the CrossTimeEdit authors train with);
    - ``"unbiased"``: torch's unbiased std plus ``eps`` 1e-4 (the GDPO authors' trl trainer); a group of one
      sample has no spread and gets 0, a batch of one is centred only (theirs would be NaN);
    - ``"population"``: the population std plus ``eps`` 1e-4 (flowalign's former form).

    A criterion on which a group ties contributes 0 to that group under every form. Computed in float64, as
    their NumPy code: near the 1e-6 floor, float32's rounding of a group mean (≈ 6e-8 for a reward near 1)
    would be a visible part of the spread. Returned in the rewards' dtype (at least float32).
    """
    if std not in GDPO_STDS:
        raise ValueError(f"unknown gdpo std {std!r}; choose one of {', '.join(GDPO_STDS)}")
    eps = (1e-6 if std == "floor" else 1e-4) if eps is None else eps
    out_dtype = torch.promote_types(components.dtype, torch.float32)
    values = components.to(torch.float64)
    unbiased = std == "unbiased"
    per_reward = []
    for m in range(values.shape[1]):
        mean, spread = _group_mean_std(values[:, m], groups, unbiased)
        scale = spread.clamp(min=eps) if std == "floor" else spread + eps
        per_reward.append((values[:, m] - mean) / scale)
    summed = torch.stack(per_reward, dim=1) @ weights.to(torch.float64)
    if unbiased and summed.numel() < 2:
        return (summed - summed.mean()).to(out_dtype)
    spread = summed.std(unbiased=unbiased)
    scale = spread.clamp(min=eps) if std == "floor" else spread + eps
    return ((summed - summed.mean()) / scale).to(out_dtype)


def win_rates(
    scores: torch.Tensor, groups: torch.Tensor, beats: Callable[[int, int], float] | None = None,
    decimals: int | None = None,
) -> torch.Tensor:
    """Pref-GRPO: ``R_i = (1/(G−1)) Σ_{j≠i} 1[i beats j]`` within each group, ``(N,)`` from ``scores`` ``(N,)``.

    ``beats(i, j)`` is a pairwise judge returning 1, 0 or 0.5 (a tie); by default scores are compared (equal
    scores: a tie, ½ each). Every other member of the group is compared, never the sample itself. ``decimals``
    rounds each rate as the authors' judge reports it (``round(wins/compared, 3)``); None keeps it exact.
    The result is float32, or float64 for float64 ``scores``.
    """
    out = torch.zeros_like(scores, dtype=torch.promote_types(scores.dtype, torch.float32))
    for g in torch.unique(groups):
        members = (groups == g).nonzero().flatten().tolist()
        if len(members) < 2:
            continue
        for i in members:
            wins = 0.0
            for j in members:
                if i == j:
                    continue
                if beats is not None:
                    wins += beats(i, j)
                else:
                    wins += 1.0 if scores[i] > scores[j] else (0.5 if scores[i] == scores[j] else 0.0)
            rate = wins / (len(members) - 1)
            out[i] = rate if decimals is None else round(rate, decimals)
    return out


def preference_win_rates(components: torch.Tensor, weights: torch.Tensor, groups: torch.Tensor,
                         judged: torch.Tensor | None = None) -> torch.Tensor:
    """Pref-GRPO's reward ``W (N,)``: each reward's within-group win rate, weight-summed,
    ``W_i = Σ_m w_m·W^(m)_i``.

    ``components`` ``(N, M)``; ``judged`` ``(M,)`` bool marks rewards that already are within-group win rates
    (a pairwise judge, e.g. UnifiedReward-Think: ``W^(m) = R^(m)``); any other reward's pairwise preference is
    the comparison of its scores (:func:`win_rates`).
    """
    judged = torch.zeros(components.shape[1], dtype=torch.bool) if judged is None else judged
    columns = [components[:, m].float() if judged[m] else win_rates(components[:, m], groups).float()
               for m in range(components.shape[1])]
    return torch.stack(columns, dim=1) @ weights.float()


WinRateNormalisation = Literal["per_reward", "weighted_sum"]
#: what the per-reward form normalises of a reward that is not a pairwise judge: its raw scores (Pref-GRPO's code)
#: or the win rates its scores give within the group (the former form)
PointwiseRewards = Literal["scores", "win_rates"]


def per_reward_win_rate_advantages(components: torch.Tensor, weights: torch.Tensor, groups: torch.Tensor,
                                   judged: torch.Tensor | None = None, *, batch_renormalise: bool = False,
                                   eps: float = 1e-8, decimals: int = 3,
                                   parts: dict[int, torch.Tensor] | None = None,
                                   pointwise: PointwiseRewards = "scores") -> torch.Tensor:
    """Pref-GRPO's advantages ``(N,)`` as the authors' code computes them (CodeGoat24/Pref-GRPO,
    ``fastvideo/rewards/dispatcher.py::compute_weighted_advantages`` with ``--use_group``):

    - each pairwise judge's win rates ``W^(m)``, rounded to ``decimals`` as their judge reports them; any other
      reward's raw scores (``pointwise="scores"``, their ``_compute_adv`` of a reward's tensor), or its scores
      compared two by two into win rates (``"win_rates"``, :func:`win_rates`, the former form);
    - each normalised within its group with the unbiased std, ``A^(m) = (W^(m) − mean_g)/(std_g + eps)``;
    - weighted after normalising, ``A = Σ_m w_m·A^(m)`` (a weight scales the advantage, it is not a share);
    - ``batch_renormalise`` (their ``--apply_gdpo``, on in their recipes): ``A ← (A − mean A)/(std A + eps)``
      over the whole gathered batch, unbiased std again.

    A judged reward with ``parts`` ``(N, 5)`` (``[overall, dim_mean, has_dims, w_o, w_d]``, UnifiedReward-Flex's
    win rates, :attr:`flowalign.reward_set.RewardScores.parts`) is its blended value as it is (not rounded); with
    ``batch_renormalise`` its advantage is their blend of the two rates' advantages,
    ``(w_o·A(overall) + w_d·A(dim_mean)) / (w_o + w_d)`` where the sample has categories, else ``A(overall)``
    (``w_d`` = 0: ``A(overall)``), as ``compute_weighted_advantages`` under ``--apply_gdpo``. A pointwise reward with
    ``parts`` (``[s_0, s_1, 1, w_0, w_1]``, UnifiedReward-Edit's two scores) always takes the blend of its parts'
    advantages, ``(w_0·A(s_0) + w_1·A(s_1)) / (w_0 + w_1)``, as their code does for its pointwise edit rewards.

    ``components`` ``(N, M)``, ``weights`` ``(M,)``, ``judged`` ``(M,)`` bool. float64 in, float64 out. A group
    of one sample has no spread (their unbiased std would be NaN): its advantage is 0.
    """
    judged = torch.zeros(components.shape[1], dtype=torch.bool) if judged is None else judged
    parts = parts or {}
    values = components.to(torch.promote_types(components.dtype, torch.float32))
    adv = torch.zeros(len(values), dtype=values.dtype, device=values.device)

    def normalised(rates: torch.Tensor) -> torch.Tensor:
        mean, std = _group_mean_std(rates, groups, unbiased=True)  # unbiased, as torch's Tensor.std() they call
        return (rates - mean) / (std + eps)

    for m in range(values.shape[1]):
        if m in parts and not judged[m]:  # a pointwise score of two parts: their blend of the parts' advantages
            p = parts[m].to(values)
            w_0, w_1 = float(p[0, 3]), float(p[0, 4])
            blended = (w_0 * normalised(p[:, 0]) + w_1 * normalised(p[:, 1])) / (w_0 + w_1 if w_0 + w_1 > 0 else 1.0)
            adv = adv + float(weights[m]) * blended
            continue
        if judged[m] and m in parts:
            p = parts[m].to(values)
            if batch_renormalise:
                w_o, w_d = float(p[0, 3]), float(p[0, 4])
                overall = normalised(p[:, 0])
                blended = (w_o * overall + w_d * normalised(p[:, 1])) / (w_o + w_d) if w_d > 0 else overall
                reward_adv = torch.where(p[:, 2] > 0, blended, overall)
            else:
                reward_adv = normalised(values[:, m])
            adv = adv + float(weights[m]) * reward_adv
            continue
        if judged[m]:
            rates = torch.tensor([round(float(v), decimals) for v in values[:, m]], dtype=values.dtype,
                                 device=values.device)
        elif pointwise == "scores":
            rates = values[:, m]
        else:
            rates = win_rates(values[:, m], groups, decimals=decimals)
        adv = adv + float(weights[m]) * normalised(rates)
    return batch_renormalised(adv, eps) if batch_renormalise else adv


def batch_renormalised(advantages: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """The authors' ``--apply_gdpo``: ``(A − mean A)/(std A + eps)`` over the whole gathered batch ``(N,)``,
    unbiased std. A batch of one sample has no spread (the unbiased std would be NaN): it is centred only."""
    if advantages.numel() < 2:
        return advantages - advantages.mean()
    return (advantages - advantages.mean()) / (advantages.std() + eps)


def dual_group_advantages(components: torch.Tensor, weights: torch.Tensor, groups: torch.Tensor,
                          pairwise_weight: float, judged: torch.Tensor | None = None, *,
                          eps: float = 1e-4) -> torch.Tensor:
    """PD-GRPO's advantages ``(N,)``: one group-relative advantage from pointwise scores and one from pairwise
    win rates, mixed, ``A = (1 − λ)·A_point + λ·A_pair`` with ``λ = pairwise_weight``:

    - ``A_point = (R − mean_g R)/(std_g R + eps)``, ``R = Σ_m w_m r^(m)`` over the pointwise rewards (those
      not ``judged``; all of them if every reward is a pairwise judge);
    - ``A_pair = (W − mean_g W)/(std_g W + eps)`` on the win rates of :func:`preference_win_rates` (a
      pairwise judge's value as it is, any other reward's scores compared two by two).

    The pairwise group sees only who beats whom (it cannot blow up a small gap nor shrink a large one); the
    pointwise group keeps how much better. λ = 0 is Flow-GRPO's ``group`` advantage, λ = 1 Pref-GRPO's.
    """
    judged = torch.zeros(components.shape[1], dtype=torch.bool) if judged is None else judged
    point = ~judged if (~judged).any() else torch.ones_like(judged)
    a_point = group_advantages(components[:, point].float() @ weights[point].float(), groups, std="group", eps=eps)
    a_pair = group_advantages(preference_win_rates(components, weights, groups, judged), groups, std="group", eps=eps)
    return (1.0 - pairwise_weight) * a_point + pairwise_weight * a_pair


def compute_advantages(
    kind: AdvantageKind,
    components: torch.Tensor,
    weights: torch.Tensor,
    groups: torch.Tensor,
    *,
    clip: float = 5.0,
    eps: float = 1e-4,
    judged: torch.Tensor | None = None,
    pairwise_weight: float = 0.5,
    win_rate_normalisation: WinRateNormalisation = "weighted_sum",
    batch_renormalise: bool = False,
    unbiased: bool = False,
    normalise_weights: bool = False,
    gdpo_std: GDPOStd = "floor",
    parts: dict[int, torch.Tensor] | None = None,
    pointwise_rewards: PointwiseRewards = "scores",
) -> torch.Tensor:
    """Advantages ``(N,)`` from raw reward components ``(N, M)`` and their weights ``(M,)``, clipped to
    ``[−clip, clip]``. Flow-GRPO's strategies normalise the weighted sum of raw rewards; ``win_rate``
    normalises within each group the win rates of :func:`preference_win_rates` (``judged``: which rewards
    are pairwise judges already), or with ``win_rate_normalisation="per_reward"`` the authors' form
    (:func:`per_reward_win_rate_advantages`); ``batch_renormalise`` (their ``--apply_gdpo``) renormalises
    either over the batch (:func:`batch_renormalised`); ``dual`` mixes a
    pointwise and a pairwise group by ``pairwise_weight`` (:func:`dual_group_advantages`); ``per_reward`` sums
    each reward's group advantage (:func:`per_reward_advantages`); ``unbiased``: the ``group``, ``global_std``
    and ``per_reward`` std divided by n − 1; ``normalise_weights``: the weights divided by their sum first (when
    it is positive), as MixGRPO's script does; ``gdpo_std``: what divides ``gdpo``'s advantages
    (:func:`gdpo_advantages`; ``"population"``, the former form, adds ``eps``); ``parts``: column → a blended
    win rate's parts, and ``pointwise_rewards`` (a score reward's raw scores or its win rates), read by the
    authors' per-reward win-rate form only."""
    if normalise_weights and float(weights.sum()) > 0:
        weights = weights / weights.sum()
    total = components.float() @ weights.float()
    if kind == "group":
        adv = group_advantages(total, groups, std="group", eps=eps, unbiased=unbiased)
    elif kind == "global_std":
        adv = group_advantages(total, groups, std="global", eps=eps, unbiased=unbiased)
    elif kind == "per_reward":
        adv = per_reward_advantages(components, weights, groups, eps=eps, unbiased=unbiased)
    elif kind == "gdpo":
        # the former form reads the caller's eps; the authors' forms carry their own constants
        adv = gdpo_advantages(components, weights, groups, std=gdpo_std, eps=eps if gdpo_std == "population" else None)
    elif kind == "win_rate" and win_rate_normalisation == "per_reward":
        adv = per_reward_win_rate_advantages(components, weights, groups, judged, batch_renormalise=batch_renormalise,
                                             parts=parts, pointwise=pointwise_rewards)
    elif kind == "win_rate":
        adv = group_advantages(preference_win_rates(components, weights, groups, judged), groups, std="group", eps=eps)
        adv = batch_renormalised(adv) if batch_renormalise else adv
    elif kind == "dual":
        adv = dual_group_advantages(components, weights, groups, pairwise_weight, judged, eps=eps)
    else:
        raise ValueError(f"unknown advantage kind {kind!r}; choose one of {', '.join(ADVANTAGE_KINDS)}")
    return adv.clamp(-clip, clip)


def best_worst_mask(advantages: torch.Tensor, groups: torch.Tensor, keep: int) -> torch.Tensor:
    """DanceGRPO's best-of-n subset: within each group, the ``keep // 2`` samples of highest and the ``keep // 2``
    of lowest advantage ``(N,)`` bool (ties broken by position, so every rank picks alike). A group of at most
    ``keep`` samples is kept whole."""
    mask = torch.zeros_like(advantages, dtype=torch.bool)
    half = keep // 2
    for g in torch.unique(groups):
        members = (groups == g).nonzero().flatten()
        if len(members) <= keep:
            mask[members] = True
            continue
        order = members[torch.sort(advantages[members], stable=True).indices]
        mask[order[:half]] = True
        mask[order[len(order) - half:]] = True
    return mask


def diversity_scaled(advantages: torch.Tensor, features: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """GARDO's diversity-aware advantages ``(N,)``: a positive advantage is multiplied by ``d_i / mean_g d``,
    where ``d_i = min_{j≠i} (1 − cos(f_i, f_j))`` is sample i's cosine distance to its nearest neighbour in
    its group (``features`` ``(N, D)``); other advantages are kept. A group whose samples all coincide
    (``mean_g d = 0``) or has one member is kept as it is."""
    out = advantages.clone().float()
    # the distances are computed where the features are (the model's device), the scaling where the advantages are
    unit = torch.nn.functional.normalize(features.flatten(1).float(), dim=1)
    for g in torch.unique(groups):
        members = (groups == g).nonzero().flatten()
        if len(members) < 2:
            continue
        f = unit[members.to(unit.device)]
        distance = 1 - (f @ f.T).clamp(-1, 1)
        distance.fill_diagonal_(float("inf"))
        nearest = distance.min(dim=1).values.to(out.device)
        mean = nearest.mean()
        if mean <= 0:
            continue
        adv = out[members]
        out[members] = torch.where(adv > 0, adv * nearest / mean, adv)
    return out
