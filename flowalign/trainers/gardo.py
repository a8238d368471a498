"""GARDO (arXiv 2512.24138): Flow-GRPO with gated, adaptive regularisation and diversity-aware advantages
(``docs/methods/gardo.md``).

Three changes to Flow-GRPO, as the authors' code makes them:

- **gated KL**: the KL term applies only to the samples whose proxy reward is least trusted. With
  ``rank(·)`` the 1-based rank over the gathered batch (1 = highest), a sample's disagreement is
  ``u_i = rank_main(i) − mean_a rank_a(i)`` (main = the proxy reward, a = the auxiliary rewards); among the
  ``u ≥ 0`` the top ``p`` fraction (``u_i > quantile_{1−p}``) is gated. ``p`` adapts: ×(1 + rate) when the
  batch's mean ``u≥0`` exceeds every one of the last ``window`` batches', ×(1 − rate) when below all, kept
  in ``[gate_min, gate_max]``. ``gate_side: proxy_higher`` gates with ``−u`` instead: the samples the proxy
  ranks above the auxiliaries (the paper's Eq. (7); their code gates the other side);
- **adaptive reference**: the KL's reference ``θ_ref`` is a snapshot of the policy, taken again after a
  step one of whose optimiser steps had a mean KL above ``kl_threshold``, or ``reset_every`` steps after
  the last snapshot;
- **diversity-aware advantages**: ``A_i = R_i − mean_{group} R`` (not divided by a std), a positive one
  scaled by the sample's nearest-neighbour feature distance in its group over the group's mean
  (:func:`flowalign.advantages.diversity_scaled`). The features are the final latents
  (``diversity_features: latents``) or a frozen image encoder's features of the decoded samples
  (``image_encoder``, ``diversity_encoder: {name: dinov3, path: ...}``: the authors' DINOv3 patch-token mean).

    L = mean_{i,k} max(−Â_i·r, −Â_i·clip(r, 1−ε, 1+ε)) + β·mean_{i gated, k} KL(μ_θ ‖ μ_θref)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Literal

import numpy as np
import torch
from pydantic import Field, model_validator

from flowalign.advantages import diversity_scaled
from flowalign.config import Section, changed
from flowalign.errors import UserError
from flowalign.limits import MAX_COEFFICIENT, MAX_TRAIN_STEPS
from flowalign.sampling import Rollout
from flowalign.trainers.base import StepBatch
from flowalign.trainers.copies import WeightCopy
from flowalign.trainers.frozen_encoders import FrozenEncoder, check_encoder_setting
from flowalign.trainers.flow_grpo import (
    FlowGRPOBase,
    FlowGRPOTrainer,
    SDEOptions,
    SDEWindowOptions,
    StepFractionOptions,
    StepSubsetOptions,
    StepUnit,
)
from flowalign.trainers.parts.reductions import masked_mean
from flowalign.weight_swap import swapped_in


class DiversityEncoder(Section):
    """The frozen image encoder whose features of the decoded samples GARDO's diversity factor compares
    (read with ``trainer.diversity_features: image_encoder``)."""

    #: an ``encoders`` plugin name (flowalign/plugins.py): ``dinov3`` (the authors'), ``dinov2``, or an
    #: installed package's
    name: str = "dinov3"
    #: the encoder's local model folder (dinov3: facebook/dinov3-vitl16-pretrain-lvd1689m); nothing is fetched
    path: str | None = None
    #: the encoder's compute dtype (the authors run DINOv3 in float32)
    dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    #: the encoder's own options (dinov3: ``resolution`` 256, ``pool`` patch_mean | cls)
    options: dict[str, Any] = Field(default_factory=dict)


class GARDOConfig(FlowGRPOBase, SDEOptions, SDEWindowOptions, StepFractionOptions, StepSubsetOptions):
    name: Literal["gardo"] = "gardo"  # type: ignore[assignment]
    #: what runs saved before these options existed computed (see TrainerConfig.before)
    before = {"centred_advantage": False}
    sampler: Literal["flow_grpo"] = "flow_grpo"  # type: ignore[assignment]
    #: the proxy reward whose advantages train (its name in rewards:); None: the first. The other rewards
    #: are the auxiliaries the gate compares it with (give them weight 0 to train on the proxy alone)
    main_reward: str | None = None
    #: false: the KL applies to every sample (an adaptive reference alone)
    gate: bool = True
    #: which side of the disagreement is gated: "proxy_lower" (the authors' code) the samples the proxy ranks
    #: below the auxiliaries' mean rank; "proxy_higher" those it ranks above it (a proxy reward the
    #: auxiliaries do not back, as the authors' prose puts it; docs/methods/gardo.md)
    gate_side: Literal["proxy_lower", "proxy_higher"] = "proxy_lower"
    #: p, the gated fraction of the samples with u ≥ 0, at the start
    gate_fraction: float = Field(0.1, gt=0, le=1)
    #: the least p may shrink to
    gate_min: float = Field(0.02, gt=0, le=1)
    #: the most p may grow to
    gate_max: float = Field(0.2, gt=0, le=1)
    #: p's relative change when the batch's mean disagreement leaves the range of the last gate_window
    gate_rate: float = Field(0.1, ge=0, lt=1)
    #: how many past batches' mean disagreements p is compared with
    gate_window: int = Field(20, ge=1, le=MAX_TRAIN_STEPS)
    #: a step with an optimiser step whose mean KL exceeds this takes a new reference snapshot (the authors
    #: tune it per task)
    kl_threshold: float = Field(3e-4, gt=0, le=MAX_COEFFICIENT)
    #: training steps after which the reference is refreshed anyway
    reset_every: int = Field(15, ge=1, le=MAX_TRAIN_STEPS)
    #: scale positive advantages by the sample's distance to its group (features: diversity_features)
    diversity: bool = True
    #: what the diversity distances are measured in: "latents", the rollouts' final latents (the default: needs
    #: no weights, as the tiny recipes); "image_encoder", diversity_encoder's features of the decoded samples
    #: (the authors': DINOv3 ViT-L/16's patch-token mean, docs/methods/gardo.md)
    diversity_features: Literal["latents", "image_encoder"] = "latents"
    #: the encoder of diversity_features=image_encoder
    diversity_encoder: DiversityEncoder = Field(default_factory=DiversityEncoder)
    #: true (the authors'): the advantage is the weighted reward minus its prompt group's mean, not divided by
    #: a std (then ±adv_clip); false: the loop's trainer.advantage normalisation
    centred_advantage: bool = True

    @model_validator(mode="after")
    def _advantage_read_by_the_loop_form(self) -> GARDOConfig:
        # the loop's advantage kind is unread by the authors' centred form: refuse it rather than ignore it
        if self.centred_advantage and changed(self, "advantage"):
            raise ValueError(f"trainer.advantage={self.advantage} is read only with trainer.centred_advantage=false "
                             "(gardo's default is the authors' reward minus its group mean): drop it or set "
                             "trainer.centred_advantage=false")
        return self

    @model_validator(mode="after")
    def _encoder_read_by_the_encoder_form(self) -> GARDOConfig:
        # an encoder the latent form would never load: refuse it rather than ignore it
        if changed(self, "diversity_encoder") and self.diversity_features != "image_encoder":
            raise ValueError("trainer.diversity_encoder is read only with trainer.diversity_features=image_encoder "
                             f"(it is {self.diversity_features}): set that, or drop the encoder")
        return self


# ---------------------------------------------------------------------------------------------- the pieces


def rank_disagreement(main: torch.Tensor, auxiliary: torch.Tensor) -> torch.Tensor:
    """``u (N,)``: the rank of each sample under ``main`` ``(N,)`` minus its mean rank under the auxiliary
    rewards ``(N, A)``; ranks are 1-based over the batch, 1 for the highest value (ties by position)."""
    def ranks(x: torch.Tensor) -> torch.Tensor:
        out = torch.empty(len(x))
        out[torch.sort(x.float(), descending=True, stable=True).indices] = torch.arange(1, len(x) + 1).float()
        return out

    return ranks(main) - torch.stack([ranks(auxiliary[:, a]) for a in range(auxiliary.shape[1])]).mean(0)


def gate_score(main: torch.Tensor, auxiliary: torch.Tensor, side: str) -> torch.Tensor:
    """``(N,)``: what the gate ranks, :func:`rank_disagreement` (``side="proxy_lower"``, the authors' code: large
    where the proxy ``main`` ``(N,)`` ranks a sample below the auxiliaries ``(N, A)``) or its negation
    (``"proxy_higher"``: large where the proxy ranks it above them)."""
    u = rank_disagreement(main, auxiliary)
    return u if side == "proxy_lower" else -u


def gate_mask(u: torch.Tensor, fraction: float) -> torch.Tensor:
    """``(N,)`` bool: ``u_i > q``, ``q`` the ``1 − fraction`` quantile (linear) of the non-negative ``u``
    (none gated when no ``u`` is non-negative)."""
    nonneg = u[u >= 0]
    if not len(nonneg):
        return torch.zeros_like(u, dtype=torch.bool)
    return u > torch.quantile(nonneg.double(), 1 - fraction).float()


def next_gate_fraction(fraction: float, history: list[float], level: float, base: float, low: float,
                       high: float, rate: float, window: int) -> tuple[float, list[float]]:
    """The gated fraction after a batch whose mean non-negative disagreement is ``level``, and the updated
    history of levels: ``base`` at the first batch; ×(1 + rate) above every level of ``history``,
    ×(1 − rate) below all; clipped to ``[low, high]``; the history keeps its last ``window`` levels."""
    if not history:
        fraction = base
    elif level > max(history):
        fraction *= 1 + rate
    elif level < min(history):
        fraction *= 1 - rate
    return float(np.clip(fraction, low, high)), (history + [level])[-window:]


def gated_kl(kl: torch.Tensor, gated: torch.Tensor) -> torch.Tensor:
    """The KL term of one unit: the mean of ``kl`` ``(B,)`` over the ``gated`` samples, 0 when none is."""
    return masked_mean(kl, gated)


def refresh_due(update_kls: Sequence[float], threshold: float, after: int, last: int, every: int) -> bool:
    """Whether the reference takes a new snapshot after the step that leaves ``after`` steps done: one of its
    optimiser steps' mean KLs ``update_kls`` exceeded ``threshold`` (the authors test every optimiser step,
    not the step's mean), or more than ``every`` steps passed since the snapshot taken at ``last``."""
    return any(k > threshold for k in update_kls) or after - last > every


def centred_advantages(totals: torch.Tensor, prompt_ids: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """The authors' GARDO advantage before the diversity factor ``(N,)``: each weighted reward ``totals (N,)``
    minus the mean of its prompt's valid samples, not divided by a std; 0 for an invalid sample."""
    out = torch.zeros_like(totals, dtype=torch.float64)
    for p in torch.unique(prompt_ids):
        good = (prompt_ids == p) & valid
        if good.any():
            out[good] = totals[good].double() - totals[good].double().mean()
    return out


# ---------------------------------------------------------------------------------------------- hooks


@dataclass
class GatedBatch(StepBatch):
    """The loop's batch with each sample's KL ``gate`` ``(N,)`` and the gate controller's state after it
    (``gate_state``: committed by :meth:`GARDOTrainer.finish`)."""

    gate: torch.Tensor | None = None
    gate_state: dict[str, Any] = field(default_factory=dict)


class GARDOTrainer(FlowGRPOTrainer):
    Config = GARDOConfig
    tcfg: GARDOConfig

    def __init__(self, *args: Any, **kw: Any):
        super().__init__(*args, **kw)
        #: θ_ref: a snapshot of the trainable weights (the starting ones until the first refresh)
        self.reference = [p.detach().clone() for p in self.params]
        self.last_refresh = 0
        self.gate_fraction, self.gate_history = self.tcfg.gate_fraction, []
        #: the frozen image encoder of diversity_features=image_encoder (None: the latents are the features)
        declared = self.frozen_encoders(self.tcfg)
        self.encoder = self.load_encoder(declared[0]) if declared else None

    def load_encoder(self, e: FrozenEncoder) -> Any:
        """The declared encoder ``e`` from its ``encoders`` plugin, frozen on the policy's device."""
        from flowalign.plugins import load_encoder

        encoder = load_encoder(e.name, e.path, setting=e.setting, dtype=e.torch_dtype, **e.options)
        encoder.model.to(self.policy.device)
        return encoder

    @classmethod
    def frozen_encoders(cls, tcfg: GARDOConfig) -> list[FrozenEncoder]:
        """``trainer.diversity_encoder`` where the diversity factor reads an encoder's features
        (``diversity_features: image_encoder``), held on the policy's device all run; none with the latents."""
        if not (tcfg.diversity and tcfg.diversity_features == "image_encoder"):
            return []
        e = tcfg.diversity_encoder
        return [FrozenEncoder("trainer.diversity_encoder", e.name, e.path, e.dtype, dict(e.options))]

    @classmethod
    def weight_copies(cls, cfg, tcfg) -> list[WeightCopy]:
        """θ_ref, a snapshot of the trained weights (not the starting weights: no reference copy), held whatever
        ``beta``."""
        return [WeightCopy("snapshot", "trained")]

    @classmethod
    def step_holdings(cls, tcfg: GARDOConfig) -> Any:
        """What a step holds per prompt (a :class:`flowalign.plan_holdings.StepHoldings`). The loop's rollouts, with their final latents concatenated once for the diversity features
        (``diversity_features: latents``; an encoder's features are ``(N, D)``, small; its frozen weights are
        declared by :meth:`frozen_encoders` and counted with the frozen reward models). The
        reference snapshot is a copy of the trained tensors held all along (the weight copies count it with the
        EMA's, in every phase). With a KL (``beta > 0``) the reference's step means are computed with the
        snapshot swapped into the live parameters (the live values kept meanwhile) while the rewards are scored
        and before the update (:meth:`reference_steps` float32 latents a sample, kept through the update);
        its refresh after the optimiser steps holds the old and new snapshot at once. Both are outside the
        update, while the gradients are freed. Without a KL none of this happens. GARDO refuses fsdp, so the
        means are always stored."""
        from flowalign.plan_holdings import Holding, StepHoldings, loop_holdings

        g = tcfg.group_size
        base = loop_holdings(g)
        # the latent form concatenates the group's final latents once; the encoder's features are (N, D), small
        latent_features = tcfg.diversity and tcfg.diversity_features == "latents"
        moments = base.moments + ((Holding(rollouts=g, latents=g),) if latent_features else ())
        if tcfg.beta <= 0:
            return StepHoldings(base.update, moments, swaps=False)
        means = g * cls.reference_steps(tcfg)
        held = Holding(rollouts=g, latents=means)
        return StepHoldings(held, (*moments, Holding(rollouts=g, latents=means, swapping=True)), swaps=True)

    @classmethod
    def check_config(cls, cfg, tcfg) -> None:
        super().check_config(cfg, tcfg)
        names = [r.key for r in cfg.rewards]
        if tcfg.main_reward is not None and tcfg.main_reward not in names:
            raise UserError(f"trainer.main_reward={tcfg.main_reward!r} is not one of the run's rewards "
                            f"({', '.join(names)}); name one of them, or null for the first")
        if tcfg.gate and tcfg.beta > 0 and len(names) < 2:
            raise UserError("trainer.gate: gardo gates its KL by comparing the main reward with auxiliary rewards;"
                            " add one (e.g. rewards='[{name: vvr}, {name: vvr_soft, weight: 0}]') or set "
                            "trainer.gate=false")
        if not tcfg.gate_min <= tcfg.gate_fraction <= tcfg.gate_max:
            raise UserError(f"trainer.gate_fraction={tcfg.gate_fraction} must lie within trainer.gate_min="
                            f"{tcfg.gate_min} … trainer.gate_max={tcfg.gate_max}")
        if tcfg.diversity and tcfg.diversity_features == "image_encoder":
            e = tcfg.diversity_encoder
            check_encoder_setting("trainer.diversity_encoder", e.name, e.path,
                                  "trainer.diversity_features=image_encoder",
                                  "dinov3: facebook/dinov3-vitl16-pretrain-lvd1689m",
                                  "trainer.diversity_features=latents")
        if cfg.parallel.strategy == "fsdp":
            raise UserError("parallel.strategy=fsdp: gardo keeps a snapshot of the whole trainable weights as its "
                            "reference, not written for sharded weights yet; use parallel.strategy=ddp")

    def main_index(self, names: list[str]) -> int:
        return 0 if self.tcfg.main_reward is None else names.index(self.tcfg.main_reward)

    def collect(self, step: int) -> GatedBatch:
        """The loop's batch with the authors' advantages (centred, positive ones scaled by diversity) and each
        sample's KL gate."""
        batch = super().collect(step)
        advantages = self.centred(batch) if self.tcfg.centred_advantage else batch.advantages
        if self.tcfg.diversity:
            advantages = diversity_scaled(advantages, self.diversity_features(batch), batch.prompt_ids)
        advantages = advantages.float().clamp(-self.tcfg.adv_clip, self.tcfg.adv_clip)
        gate, state, logs = self.gate_batch(batch)
        loops = {f.name: getattr(batch, f.name) for f in fields(StepBatch)}
        return GatedBatch(**{**loops, "advantages": advantages, "logs": {**batch.logs, **logs}}, gate=gate,
                          gate_state=state)

    def diversity_features(self, batch: StepBatch) -> torch.Tensor:
        """The features ``(N, D)`` whose nearest-neighbour cosine distances scale the positive advantages: the
        final latents flattened, or the frozen encoder's features of the decoded samples (images in [0, 1],
        encoded chunk by chunk without gradients, as the authors embed each sampled batch)."""
        if self.encoder is None:
            return torch.cat([c.final_latents for c in batch.chunks]).flatten(1)
        out = []
        for chunk in batch.chunks:
            if chunk.samples is None or chunk.samples.dim() != 4:
                raise UserError("trainer.diversity_features=image_encoder embeds decoded images (B, 3, H, W); these "
                                "rollouts have none (a video model?): use trainer.diversity_features=latents")
            with torch.no_grad():
                out.append(self.encoder.encode_images(chunk.samples.to(self.policy.device)).float())
        return torch.cat(out)

    def centred(self, batch: StepBatch) -> torch.Tensor:
        """This rank's :func:`centred_advantages` ``(N,)``, each group's mean taken over every rank's samples of
        its prompt (as the loop's advantages)."""
        s = batch.scores
        totals = self.gather(s.values.float()) @ s.weights.float()
        valid, ids = self.gather(s.valid.float()).bool(), self.gather(batch.prompt_ids)
        n = len(s)
        return centred_advantages(totals, ids, valid)[self.rank * n : (self.rank + 1) * n]

    def gate_batch(self, batch: StepBatch) -> tuple[torch.Tensor, dict[str, Any], dict[str, float]]:
        """This rank's gate ``(N,)``, decided on every rank's rewards, and the controller's next state."""
        n = len(batch.scores)
        if not self.tcfg.gate or self.tcfg.beta == 0:
            return torch.ones(n, dtype=torch.bool), {}, {}
        values = self.gather(batch.scores.values)
        valid = self.gather(batch.scores.valid.float()).bool()
        m = self.main_index(batch.scores.names)
        aux = [a for a in range(values.shape[1]) if a != m]
        u = torch.full((len(values),), -1.0)
        u[valid] = gate_score(values[valid, m], values[valid][:, aux], self.tcfg.gate_side)
        nonneg = u[valid & (u >= 0)]
        level = nonneg.mean().item() if len(nonneg) else 0.0
        t = self.tcfg
        fraction, history = next_gate_fraction(self.gate_fraction, self.gate_history, level, t.gate_fraction,
                                               t.gate_min, t.gate_max, t.gate_rate, t.gate_window)
        gate = gate_mask(u, fraction) & valid
        mine = gate[self.rank * n : (self.rank + 1) * n]
        return mine, {"fraction": fraction, "history": history}, {
            "gate/fraction": fraction, "gate/gated": gate.float().mean().item(), "gate/disagreement": level}

    def kl_penalty(self, batch: GatedBatch, unit: StepUnit, kl: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
        gate = batch.per_chunk(batch.gate)[unit.chunk].to(active.device, non_blocking=True)
        return gated_kl(kl, active & gate)

    def reference_mean(self, chunk: Rollout, k: int) -> torch.Tensor:
        """``μ_ref`` at step ``k``: the step's Gaussian mean under the reference snapshot θ_ref, no grad."""
        x_k = chunk.step(k)[0]
        with torch.no_grad(), swapped_in(self.params, self.reference):
            v = self.policy.velocity(x_k, chunk.sigmas[k].item(), chunk.cond, chunk.guidance_scale)
            return self.step_distribution(chunk, k, v).mean

    def finish(self, batch: GatedBatch, steps: list[dict[str, list[float]]]) -> dict[str, float]:
        """The gate's next state, then the reference refresh (:func:`refresh_due`): a new snapshot when one
        optimiser step's mean KL (over every rank's units: the loss logs each unit's gated KL as ``kl``)
        exceeded ``kl_threshold`` or ``reset_every`` steps have passed since the last one (decided alike on
        every rank)."""
        if batch.gate_state:
            self.gate_fraction, self.gate_history = batch.gate_state["fraction"], batch.gate_state["history"]
        if self.tcfg.beta <= 0:
            return {}
        totals = [[0.0, 0] for _ in steps]  # each optimiser step's KL sum and unit count over every rank
        for part in self.gather_objects([(sum(s.get("kl", [])), len(s.get("kl", []))) for s in steps]):
            for total, (kl, count) in zip(totals, part):
                total[0], total[1] = total[0] + kl, total[1] + count
        per_step = [kl / count for kl, count in totals if count]
        after = self.step + 1
        if refresh_due(per_step, self.tcfg.kl_threshold, after, self.last_refresh, self.tcfg.reset_every):
            self.reference = [p.detach().clone() for p in self.params]
            self.last_refresh = after
        return {"reference_age": float(after - self.last_refresh), "kl_update_max": max(per_step, default=0.0)}

    def state_dict(self) -> dict[str, Any]:
        return {**{f"reference.{i}": t for i, t in enumerate(self.reference)}, "last_refresh": self.last_refresh,
                "gate_fraction": self.gate_fraction, "gate_history": list(self.gate_history)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.reference = [state[f"reference.{i}"].clone().to(p) for i, p in enumerate(self.params)]
        self.last_refresh = int(state["last_refresh"])
        self.gate_fraction, self.gate_history = float(state["gate_fraction"]), [float(x) for x in state["gate_history"]]
