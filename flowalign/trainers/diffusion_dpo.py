"""Diffusion-DPO ("Diffusion Model Alignment Using Direct Preference Optimization", arXiv 2311.12908;
``docs/methods/diffusion_dpo.md``), in its flow-matching form.

A preference pair (x0ʷ ≻ x0ˡ, prompt c) is noised at one shared t with one shared ε,
``x_t = (1−t)·x0 + t·ε``; with the velocity errors ``e(x0) = mean(v(x_t, t | c) − (ε − x0))²`` of the
policy and of the reference (the adapter switched off, or the frozen copy under full fine-tuning)

    Δ = [e_θ(x0ʷ) − e_ref(x0ʷ)] − [e_θ(x0ˡ) − e_ref(x0ˡ)],      L = −log σ(−β·Δ/2)

(the DDPM ε-MSE of the paper replaced by the flow's velocity MSE). t is Flow-Factory's draw by default
(``timestep_draw: shared``): one t for all pairs of a micro-batch (``batch_size`` consecutive pairs of the
step's global order, so any rank layout draws alike), ``1 − timestep_range·clamp(σ(n), 0.01, 1 − 1e−6)``; ``per_pair`` is the former draw, σ(n) for each pair. Pairs come from a Pick-a-Pic-style
JSONL (``trainer.pairs``: prompt, chosen and rejected image paths, encoded with the policy's VAE) or
online: each prompt group's best and worst rollout under the run's rewards.
"""

from __future__ import annotations

from collections.abc import Callable

from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.nn.functional as F
from pydantic import Field

from flowalign.data import PromptSet
from flowalign.errors import UserError
from flowalign.limits import MAX_COEFFICIENT, MAX_UPDATES
from flowalign.protocols import Conditioning
from flowalign.trainers.base import GroupTrainer, Plan, StepBatch, derived_seed
from flowalign.trainers.copies import WeightCopy, full_reference
from flowalign.trainers.options import InnerEpochOptions, ReferenceOptions, RolloutOptions, TrainerConfig
from flowalign.trainers.parts.reductions import per_sample_mean
from flowalign.trainers.parts.rewarded_rollouts import rewarded_rollouts
from flowalign.trainers.parts.timesteps import pair_timesteps


class DiffusionDPOConfig(TrainerConfig, RolloutOptions, InnerEpochOptions, ReferenceOptions):
    """The loop's group rollouts (online pairs: a group's best and worst by reward, no advantages);
    ``inner_epochs`` optimiser steps over the batch's pairs (each one pass over all of them, with its own
    micro-batches, t and ε under ``noise_draw: per_inner_epoch``)."""

    name: Literal["diffusion_dpo"] = "diffusion_dpo"
    #: β of the DPO (large: the per-pair error differences are ~1e-3)
    dpo_beta: float = Field(2000.0, gt=0, le=MAX_COEFFICIENT)
    #: offline preference triples (JSONL of prompt, chosen, rejected image paths); None: online pairs
    pairs: str | None = None
    #: the unit draw behind t: "logit_normal" (σ(n), n ~ N(0, 1)) or "uniform" on (0, 1)
    timestep_sampling: Literal["logit_normal", "uniform"] = "logit_normal"
    #: "shared": Flow-Factory's DPOTrainer, one t for all pairs of a micro-batch (``batch_size`` pairs,
    #: consecutive in the step's global order, whichever ranks hold them), t = 1 − timestep_range·u with
    #: u = clamp(σ(n), 0.01, 1 − 1e−6) (logit_normal) or U(0, 1) (uniform), drawn from the generator of the
    #: micro-batch's first position; "per_pair": the former form, each pair its own t, σ(n)
    #: or U(0, 1) clamped to [1e−4, 1 − 1e−4], timestep_range unused
    timestep_draw: Literal["shared", "per_pair"] = "shared"
    #: the share of the path from noise (t = 1) towards the data that "shared" draws t on: t ≥ 1 − timestep_range
    #: (Flow-Factory's default 0.99: t ≥ 0.01, so no pair is scored at the clean image)
    timestep_range: float = Field(0.99, gt=0, le=1)
    #: online pairs, a group whose valid rewards all tie: "self_pair" (Flow-Factory's: its argmax and argmin are
    #: the same first sample, a pair whose loss is log 2 with a zero gradient, counted among the step's pairs,
    #: in its micro-batch and as a tie in the implicit accuracy); "dropped": no pair (the former form)
    tied_groups: Literal["self_pair", "dropped"] = "self_pair"
    #: inner_epochs > 1: "per_inner_epoch" (Flow-Factory's: each inner epoch permutes the pairs anew, keyed by
    #: (seed, step, inner epoch), cuts them into micro-batches and draws their t and ε afresh, each pair from a
    #: generator keyed by (seed, step, pair, inner epoch)); "per_step": every inner epoch trains the first one's
    #: micro-batches with the same t and ε (the former form). The same with inner_epochs: 1
    noise_draw: Literal["per_inner_epoch", "per_step"] = "per_inner_epoch"
    #: "shuffled": the first inner epoch's pairs are permuted too before they are cut into micro-batches, as
    #: Flow-Factory's loop permutes every inner epoch's (keyed by (seed, step, 0)); "in_order": the first inner
    #: epoch's micro-batches follow the step's pairs in order (the former form). Under timestep_draw: shared it
    #: decides which pairs share a t; per pair it changes no number
    epoch_order: Literal["shuffled", "in_order"] = "shuffled"

    #: what runs saved before these options existed computed (see TrainerConfig.before)
    before = {"timestep_draw": "per_pair", "tied_groups": "dropped", "noise_draw": "per_step",
              "epoch_order": "in_order"}
    #: noise_draw's former form differs only with several inner epochs (the first one draws alike); epoch_order's
    #: only where a micro-batch shares its t
    before_when = {"noise_draw": ("inner_epochs", tuple(range(2, MAX_UPDATES + 1))),
                   "epoch_order": ("timestep_draw", ("shared",))}


# ---------------------------------------------------------------------------------------------- the loss


def dpo_timesteps(generators: list[torch.Generator], sampling: str, draw: str, timestep_range: float,
                  shared_units: torch.Tensor | None = None) -> torch.Tensor:
    """``(P,)`` flow times of P pairs, one unit draw from each pair's generator (so every pair's ε, drawn after
    it from the same generator, is the same under either ``draw``).

    ``per_pair``: each pair's own t, :func:`pair_timesteps` (the former form). ``shared``: Flow-Factory's
    ``DPOTrainer._sample_timesteps`` with ``num_train_timesteps`` 1, one t for a micro-batch of pairs, mapped
    by :func:`shared_timestep` from ``shared_units`` ``(P,)``: each pair's micro-batch's one unit draw (their one
    draw per micro-batch comes from the global RNG; see :func:`micro_batch_units` for the keyed one). None:
    the pairs are one micro-batch, its draw the first pair's."""
    if draw == "per_pair":
        return torch.cat([pair_timesteps(1, sampling, g) for g in generators])
    units = torch.cat([torch.rand(1, generator=g) if sampling == "uniform" else torch.randn(1, generator=g)
                       for g in generators])
    if shared_units is None:
        shared_units = units[:1].expand(len(generators))
    return shared_timestep(shared_units, sampling, timestep_range).clone()


def micro_batch_units(positions: list[int], size: int, sampling: str, key: Callable[[int], int]) -> torch.Tensor:
    """``(P,)`` the unit draw of each pair's micro-batch: pairs at global ``positions`` fall in micro-batches of
    ``size`` consecutive positions, each drawing once from the generator seeded ``key(first position)`` (the
    seed of its first pair, so a micro-batch whose pairs are all here draws what its first pair's own
    generator draws first), the same whatever the rank layout."""
    draws: dict[int, torch.Tensor] = {}
    if not positions:  # a step whose groups all tied has no pair
        return torch.zeros(0)
    for k in positions:
        first = k // size * size
        if first not in draws:
            g = torch.Generator().manual_seed(key(first))
            draws[first] = torch.rand(1, generator=g) if sampling == "uniform" else torch.randn(1, generator=g)
    return torch.cat([draws[k // size * size] for k in positions])


def shared_timestep(unit: torch.Tensor, sampling: str, timestep_range: float) -> torch.Tensor:
    """Flow-Factory's t (σ of ``x_t = (1−σ)·x0 + σ·ε``) ``(...)`` from a unit draw ``(...)``: a standard normal n
    (``logit_normal``: u = clamp(σ(n), 0.01, 1 − 1e−6), their ``TimeSampler.logit_normal_shifted`` with mean 0,
    std 1, shift 1) or a uniform u (``uniform``: their ``TimeSampler.uniform`` of one timestep, unclamped);
    ``t = 1 − timestep_range·u`` (their scheduler time ``1000·(1 − frac)`` over 1000, frac = range·u)."""
    u = unit if sampling == "uniform" else torch.sigmoid(unit).clamp(0.01, 1.0 - 1e-6)
    return 1.0 - timestep_range * u


def diffusion_dpo_loss(err_w: torch.Tensor, err_l: torch.Tensor, ref_w: torch.Tensor, ref_l: torch.Tensor,
                       beta: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-pair ``−log σ(−β/2·[(e_θʷ − e_refʷ) − (e_θˡ − e_refˡ)])`` ``(P,)`` from errors ``(P,)``; the references
    are detached. ``implicit_acc`` is the share of pairs whose implicit reward −β/2·(e_θ − e_ref) ranks the
    chosen image strictly above the rejected one: a tie counts 0, as Flow-Factory's ``implicit_accuracy``
    (at θ = θ_ref every pair ties, so a run's first step logs 0)."""
    delta = (err_w - ref_w.detach()) - (err_l - ref_l.detach())
    inside = -0.5 * beta * delta
    loss = -F.logsigmoid(inside)
    accuracy = (inside > 0).float().mean()
    return loss, {"dpo_loss": loss.detach().mean(), "implicit_acc": accuracy.detach(), "margin": inside.detach().mean()}


def best_and_worst(rewards: torch.Tensor, valid: torch.Tensor, tied: str = "dropped") -> tuple[int, int] | None:
    """Indices (best, worst) of a group's valid rewards (the first of equal ones, as numpy's argmax / argmin),
    or None with fewer than two valid; when all of them tie, None (``tied`` "dropped") or the first valid
    sample twice ("self_pair", Flow-Factory's ``_form_pairs_from_advantages``)."""
    idx = valid.nonzero().flatten()
    if len(idx) < 2 or (tied == "dropped" and rewards[idx].max() == rewards[idx].min()):
        return None
    r = rewards[idx]
    return int(idx[r.argmax()]), int(idx[r.argmin()])


# ---------------------------------------------------------------------------------------------- hooks


@dataclass
class PairBatch:
    """One step's preference pairs on this rank: endpoints ``x_w, x_l (P, ...)``, conditioning, a seed per
    pair (its identity in any rank layout), and logs."""

    x_w: torch.Tensor
    x_l: torch.Tensor
    cond: Conditioning | None
    seeds: list[int]
    logs: dict[str, Any] = field(default_factory=dict)
    #: each pair's position in the step's global order (its seed's key), and the step: which pairs share a
    #: micro-batch's t (``timestep_draw: shared``) whatever the rank layout
    positions: list[int] = field(default_factory=list)
    step: int = 0


@dataclass(frozen=True)
class PairUnit:
    """Pairs ``index`` of the batch with their t, ε and reference errors; ``total`` pairs over all ranks."""

    index: tuple[int, ...]
    t: torch.Tensor
    eps: torch.Tensor
    ref_w: torch.Tensor
    ref_l: torch.Tensor
    total: int


class DiffusionDPOTrainer(GroupTrainer):
    Config = DiffusionDPOConfig
    tcfg: DiffusionDPOConfig
    sampler = "ode"

    @classmethod
    def check_config(cls, cfg, tcfg: DiffusionDPOConfig) -> None:
        if not tcfg.pairs:  # offline pairs carry their labels: rewards: [] is fine there
            super().check_config(cfg, tcfg)

    @classmethod
    def weight_copies(cls, cfg, tcfg) -> list[WeightCopy]:
        return full_reference(tcfg) if cfg.model.finetune == "full" else []

    @classmethod
    def step_holdings(cls, tcfg: DiffusionDPOConfig) -> Any:
        """What a step holds per prompt (a :class:`flowalign.plan_holdings.StepHoldings`). Through the update, at most one pair a prompt, its two float32 latents and one conditioning. Offline
        pairs (``trainer.pairs``) draw no rollout: the two images are loaded at the model's size (float32
        pixels, a decoded sample's size) and encoded one at a time (the VAE encoder's peak for one image).
        Online pairs are picked from the loop's ``group_size`` rollouts, which are held only while sampling and
        picking: the final latents and conditioning of all of them are concatenated there, beside the pair cut
        from them. A subclass with a ``collect`` of its own gets the loop's default until it states its own."""
        from flowalign.plan_holdings import Holding, StepHoldings

        if cls.collect is not DiffusionDPOTrainer.collect:  # a subclass collecting its own batch (SePPO)
            return super().step_holdings(tcfg)
        pair = Holding(latents=2, conditionings=1)
        if tcfg.pairs:
            return StepHoldings(pair, (Holding(latents=2, conditionings=1, decoded=2, encoding=True),),
                                samples_per_prompt=0)
        g = tcfg.group_size
        return StepHoldings(pair, (Holding(rollouts=g, decoding=True),
                                   Holding(rollouts=g, latents=g + 2, conditionings=g + 1)))

    def __init__(self, *args: Any, **kw: Any):
        super().__init__(*args, **kw)
        self.offline = self.offline_pair_set()

    def offline_pair_set(self) -> PromptSet | None:
        """The preference triples of ``trainer.pairs``, every image checked before compute (None: online)."""
        if not self.tcfg.pairs:
            return None
        from flowalign.trainers.parts.pairs import read_preference_pairs

        offline = read_preference_pairs(self.tcfg.pairs)
        if not hasattr(self.policy, "encode_images"):
            raise UserError(f"trainer.pairs: the {self.policy.family} policy cannot encode images (no "
                            "encode_images); use online pairs (drop trainer.pairs) or an image model")
        return offline

    # ------------------------------------------------------------------ pairs

    def collect(self, step: int) -> PairBatch:
        return self.offline_pairs(step) if self.offline is not None else self.online_pairs(step)

    def offline_pairs(self, step: int) -> PairBatch:
        """This rank's share of the step's preference triples, encoded with the policy's VAE."""
        from flowalign.trainers.parts.pairs import load_image

        p = self.tcfg.prompts_per_step
        idx = self.offline.batch_indices(self.cfg.run.seed, step, p * self.world)[self.rank * p : (self.rank + 1) * p]
        h, w = int(self.policy.defaults["height"]), int(self.policy.defaults["width"])
        meta = [self.offline.metadata[i] for i in idx]
        images = {k: torch.stack([load_image(m[k], h, w) for m in meta]).to(self.policy.device) for k in ("chosen", "rejected")}
        x_w, x_l = self.policy.encode_images(images["chosen"]), self.policy.encode_images(images["rejected"])
        cond = self.policy.encode([self.offline.prompts[i] for i in idx])
        positions = [self.rank * p + n for n in range(len(idx))]
        seeds = [derived_seed(self.cfg.run.seed, step, k, 47) for k in positions]
        return PairBatch(x_w.float(), x_l.float(), cond, seeds, {"train/pairs": float(len(idx))}, positions, step)

    def online_pairs(self, step: int) -> PairBatch:
        """The loop's group rollouts; per group, its best and worst valid sample."""
        batch: StepBatch = rewarded_rollouts(self, step)
        x0 = torch.cat([c.final_latents for c in batch.chunks])
        cond = Conditioning.cat([c.cond for c in batch.chunks])
        total, valid = batch.scores.total, batch.scores.valid
        win, lose, positions = [], [], []
        tied = getattr(self.tcfg, "tied_groups", "dropped")  # SePPO's config has no such option
        for g in dict.fromkeys(batch.groups.tolist()):
            members = (batch.groups == g).nonzero().flatten()
            pick = best_and_worst(total[members], valid[members], tied)
            if pick is not None:
                win.append(int(members[pick[0]]))
                lose.append(int(members[pick[1]]))
                positions.append(g)  # the group's id: its place among every rank's groups
        seeds = [derived_seed(self.cfg.run.seed, step, g, 47) for g in positions]
        logs = {**batch.logs, "train/pairs": float(len(win))}
        if not win:
            return PairBatch(x0[:0], x0[:0], None, [], logs, [], step)
        return PairBatch(x0[win], x0[lose], cond[win], seeds, logs, positions, step)

    # ------------------------------------------------------------------ hooks

    def errors(self, batch: PairBatch, index: tuple[int, ...], t: torch.Tensor,
               eps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``e(x0ʷ), e(x0ˡ)`` ``(P,)`` of the current velocity (both halves in one pass)."""
        idx = list(index)
        x0 = torch.cat([batch.x_w[idx], batch.x_l[idx]]).to(self.policy.device)
        eps2, t2 = torch.cat([eps, eps]).to(x0, non_blocking=True), torch.cat([t, t]).to(x0, non_blocking=True)
        tb = t2.view(-1, *[1] * (x0.ndim - 1))
        cond = batch.cond[idx + idx]
        v = self.policy.velocity((1 - tb) * x0 + tb * eps2, t2, cond, 1.0)
        err = per_sample_mean((v - (eps2 - x0)) ** 2)
        return err[: len(idx)], err[len(idx) :]

    def plan(self, batch: PairBatch, generator: torch.Generator) -> Plan:
        """``inner_epochs`` optimiser steps over all of the pairs (:meth:`epoch_units`), weighted over every
        rank's pairs: each inner epoch with its own micro-batches, t and ε (``noise_draw: per_inner_epoch``), or
        every one with the first one's (``per_step``, and a subclass without the option: SePPO)."""
        total = self.total(len(batch.seeds))
        first = self.epoch_units(batch, 0, total)
        fresh = getattr(self.tcfg, "noise_draw", "per_step") == "per_inner_epoch"
        epochs = [first] + [self.epoch_units(batch, e, total) if fresh else first
                            for e in range(1, self.tcfg.inner_epochs)]
        return Plan(epochs if total else [], global_weights=True)

    def epoch_units(self, batch: PairBatch, epoch: int, total: int) -> list[PairUnit]:
        """Inner epoch ``epoch``'s micro-batches of ``batch_size`` of this rank's pairs, with t
        (:func:`dpo_timesteps`), each pair's ε and the reference errors.

        The pairs are placed in an order of the step's global positions (``prompts_per_step`` × ranks of them),
        ``batch_size`` consecutive places a micro-batch, whichever ranks hold its pairs, and each pair draws from
        its own generator. Epoch e: the positions permuted by a generator keyed by (seed, step, e) (Flow-Factory's
        ``randperm(len(pairs), generator=create_generator(seed, epoch, inner_epoch))`` on one process; in order at
        epoch 0 with ``epoch_order: in_order``), each pair's generator seeded ``batch.seeds`` at epoch 0, keyed by
        (seed, step, position, e) after. A shared t is its micro-batch's, drawn from the generator of the pair at
        its first place (:func:`micro_batch_units`)."""
        n, b = len(batch.seeds), self.tcfg.batch_size
        seed, sampling = self.cfg.run.seed, self.tcfg.timestep_sampling
        # first_seed: the seed of the pair at a micro-batch's first place, which draws the micro-batch's shared t
        # a subclass whose config has no epoch_order (SePPO) keeps its first epoch in order
        if epoch == 0 and getattr(self.tcfg, "epoch_order", "in_order") == "in_order":
            seeds, order, places = batch.seeds, list(range(n)), batch.positions
            first_seed = lambda first: derived_seed(seed, batch.step, first, 47)
        else:
            at = torch.randperm(self.tcfg.prompts_per_step * self.world, generator=torch.Generator().manual_seed(
                derived_seed(seed, batch.step, epoch, 53))).tolist()
            place = {k: i for i, k in enumerate(at)}
            seeds = batch.seeds if epoch == 0 else [derived_seed(seed, batch.step, k, 47, epoch) for k in batch.positions]
            places = [place[k] for k in batch.positions]
            order = sorted(range(n), key=lambda i: places[i])
            first_seed = lambda first: derived_seed(seed, batch.step, at[first], 47, *((epoch,) if epoch else ()))
        # a subclass whose config has no timestep_draw (SePPO) keeps its t per pair
        draw = getattr(self.tcfg, "timestep_draw", "per_pair")
        timestep_range = getattr(self.tcfg, "timestep_range", 1.0)
        # a shared t is its micro-batch's, b places of the step's global order, whichever rank holds them
        shared = (micro_batch_units(places, b, sampling, first_seed)
                  if draw == "shared" and n and len(batch.positions) == n else None)
        shape = batch.x_w.shape[1:]
        units = []
        for s in range(0, n, b):
            index = tuple(order[s : s + b])
            gens = [torch.Generator().manual_seed(seeds[i]) for i in index]
            t = dpo_timesteps(gens, sampling, draw, timestep_range, None if shared is None else shared[list(index)])
            # one ε per pair, shared by its chosen and rejected image (as Flow-Factory's one noise per pair)
            eps = torch.stack([torch.randn(shape, generator=g) for g in gens])
            ref_w, ref_l = self.reference_errors(batch, index, t, eps)
            units.append(PairUnit(index, t, eps, ref_w, ref_l, total))
        return units

    def reference_errors(self, batch: PairBatch, index: tuple[int, ...], t: torch.Tensor,
                         eps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``e_ref(x0ʷ), e_ref(x0ˡ)`` ``(P,)`` under the reference: the adapter switched off (or the frozen copy)."""
        with torch.no_grad(), self.policy.adapter_disabled():
            return self.errors(batch, index, t, eps)

    def loss(self, batch: PairBatch, unit: PairUnit) -> tuple[torch.Tensor, dict[str, float]]:
        err_w, err_l = self.errors(batch, unit.index, unit.t, unit.eps)
        per_pair, info = diffusion_dpo_loss(err_w, err_l, unit.ref_w.to(err_w), unit.ref_l.to(err_l),
                                            self.tcfg.dpo_beta)
        return per_pair.sum() / unit.total, info

