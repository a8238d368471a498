"""FestDPO: DPO for few-step generators with sample-based (kernel density) likelihoods.

Read against ``docs/methods/festdpo.md`` (*FestDPO: Few-Step Generator Alignment with Direct Preference
Optimization*, arXiv 2609.34673, Section 5 and Appendix E; no code of the authors is public). Per prompt c and step:

    z_1..z_K common noises;  X_k = ϕ(G_θ(z_k,c)) (with gradient),  X_k^ref = sg(ϕ(G_ref(z_k,c)))   (Sec. 5.1)
    log p̂(y) = logsumexp_k(-‖ϕ(y) - X_k‖²/(2h²)) - log K     (Eq. 7/11/21; h^-d and 2π cancel in the ratios)
    r̂_θ(y) = β·[log p̂_θ(y) - log p̂_ref(y)],   ℓ_h = -log σ(r̂_θ(y_w) - r̂_θ(y_l))                     (Eq. 8)
    L = mean over the step's pairs of mean over the bandwidths h of ℓ_h                      (Eq. 8, App. E.1)

The bandwidths are ``trainer.bandwidths`` (the paper's hand-set h values), or one h² from the median
heuristic of the reference's samples, median_{i≠j}‖X_i^ref - X_j^ref‖² / (2·log(K+1)) [derived: the paper
gives no rule], fixed for the run by default.

``G`` is the policy's own ODE sampler with ``num_steps`` Euler steps (any count; 2-4 is the few-step
regime), differentiated through every step. Pairs come from a JSONL of (prompt, chosen, rejected) images
(``trainer.pairs``; the paper's form, fixed offline pairs) or online [derived]: the K samples themselves are
scored by the run's rewards, labelled by Bradley-Terry sampling, and each y_i is scored leave-one-out (X_i
left out of both KDEs, as the paper's evaluated points are never among the KDE's samples), so no extra
sampling pass is spent. The hooks: ``collect`` draws each prompt's samples and labels (no parameter
gradient) and takes ``∂L/∂X`` of the loss on the detached features; ``plan`` makes one optimiser step of
regenerated chunks, whose ``loss`` is ``⟨ϕ(G_θ(z_chunk,c)), ∂L/∂X_chunk⟩`` (the same gradient as
back-propagating L through all K samples at once, without holding their graphs). The reference is the adapter-disabled policy (LoRA) or a frozen copy of the
trainable tensors (full fine-tuning). ϕ: the x0 latent average-pooled to ``feature_size`` (default), the
whole latent, the decoded image pooled to ``feature_size``, or a frozen pretrained encoder's features of the
decoded image (``feature: encoder``, the paper's Sec. 5.3).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import torch
import torch.nn.functional as F
from pydantic import Field, field_validator, model_validator

from flowalign.config import Section, changed
from flowalign.data import PromptSet
from flowalign.errors import UserError
from flowalign.limits import MAX_BATCH, MAX_COEFFICIENT, MAX_GROUP_SIZE, MAX_GUIDANCE, MAX_IMAGE_SIDE, MAX_LR, MAX_SAMPLING_STEPS
from flowalign.protocols import Conditioning
from flowalign.sampling import euler_step
from flowalign.trainers import unit_logs
from flowalign.trainers.base import GroupTrainer, Plan, derived_seed
from flowalign.trainers.copies import WeightCopy, full_reference
from flowalign.trainers.frozen_encoders import FrozenEncoder, check_encoder_setting
from flowalign.trainers.options import ReferenceOptions, TrainerConfig

#: fewer reference samples than this give a median of too few distances to set a bandwidth
MIN_K = 8
#: the most kernel bandwidths one loss averages over (the paper averages over two or three)
MAX_BANDWIDTHS = 16
#: one kernel bandwidth h (a standard deviation in feature units, as the paper states its values)
Bandwidth = Annotated[float, Field(gt=0, le=MAX_COEFFICIENT)]


class FeatureEncoder(Section):
    """The frozen pretrained image encoder whose features of the decoded samples the KDEs are computed in
    (``trainer.feature: encoder``; the paper's Sec. 5.3, Eq. 11)."""

    #: an ``encoders`` plugin name (flowalign/plugins.py): ``dinov2`` (one of the paper's ablation encoders,
    #: Table 2), ``dinov3``, or an installed package's
    name: str = "dinov2"
    #: the encoder's local model folder (dinov2: facebook/dinov2-base); nothing is fetched
    path: str | None = None
    #: the encoder's compute dtype
    dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    #: the encoder's own options (dinov3: ``resolution``, ``pool``)
    options: dict[str, Any] = Field(default_factory=dict)


class FestDPOConfig(TrainerConfig, ReferenceOptions):
    """FestDPO's own K samples per prompt (not the loop's group batches), labelled by reward, no advantages."""

    name: Literal["festdpo"] = "festdpo"
    #: what runs saved before these options existed computed (see TrainerConfig.before)
    before = {"loss_mean": "prompts"}
    #: prompts per step on each rank (each sampled K times)
    prompts_per_step: int = Field(4, ge=1, le=MAX_BATCH)
    #: CFG scale of the few-step sampler (None: the model's default)
    guidance_scale: float | None = Field(None, ge=0, le=MAX_GUIDANCE)
    #: samples per prompt for the KDEs (common random numbers for policy and reference); 12 is the paper's
    #: text-to-image N (Table 8; 8 and 24 in its Table 1 ablation)
    K: int = Field(12, ge=1, le=MAX_GROUP_SIZE)
    #: DPO temperature β (named apart from ``beta``, which the loop reads as a KL weight)
    dpo_beta: float = Field(1.0, gt=0, le=MAX_COEFFICIENT)
    lr: float = Field(1e-5, gt=0, le=MAX_LR)
    #: Euler steps of the few-step sampler that is trained (and differentiated through)
    num_steps: int = Field(4, ge=1, le=MAX_SAMPLING_STEPS)
    #: ϕ: ``latent_pool`` the x0 latent average-pooled to feature_size; ``latent`` the whole latent;
    #: ``pixels`` the decoded image pooled; ``encoder`` feature_encoder's features of the decoded image (the
    #: paper's form, Sec. 5.3: a pretrained encoder; it needs weights, so the default needs none)
    feature: Literal["latent_pool", "latent", "pixels", "encoder"] = "latent_pool"
    feature_size: int = Field(8, ge=1, le=MAX_IMAGE_SIDE)
    #: the encoder of feature=encoder
    feature_encoder: FeatureEncoder = Field(default_factory=FeatureEncoder)
    #: ``fixed``: h² from the reference once per run; ``per_step``: from each prompt's reference samples
    bandwidth: Literal["fixed", "per_step"] = "fixed"
    #: h² = bandwidth_scale × the median heuristic [derived knob]: wider kernels keep the likelihood ratio
    #: smooth when one update moves the samples further than the reference's own spread
    bandwidth_scale: float = Field(1.0, gt=0, le=MAX_COEFFICIENT)
    #: a fixed h² for the run instead of the median heuristic (``bandwidth_scale`` still multiplies it)
    #: [derived knob]: the heuristic's value depends on which prompts the first step draws (prompts'
    #: reference spreads can differ by orders of magnitude), so a run can pin it
    bandwidth_h2: float | None = Field(None, gt=0, le=MAX_COEFFICIENT)
    #: the kernel bandwidths h (standard deviations, not h²) the loss is averaged over, as the paper sets
    #: them by hand (App. E.1: "averaged over multiple KDE bandwidths"; Table 8: 0.15 and 0.2 for
    #: SDXL-Turbo); ``bandwidth_scale`` multiplies each h². None: one h² from the median heuristic
    #: (or bandwidth_h2)
    bandwidths: list[Bandwidth] | None = Field(None, min_length=1, max_length=MAX_BANDWIDTHS)
    #: ``pairs``: the loss is the mean over every pair of the step (all ranks), Eq. 8's expectation over
    #: pairs; ``prompts`` (the former form): each prompt's mean over its pairs, divided by prompts_per_step
    #: (a prompt with fewer pairs weighs its pairs more, and a step with prompts without pairs steps less)
    loss_mean: Literal["pairs", "prompts"] = "pairs"
    #: offline preference triples (JSONL of prompt, chosen, rejected image paths); None: online pairs
    pairs: str | None = None
    #: online: labelled pairs per prompt, drawn among the K scored samples
    pairs_per_prompt: int = Field(8, ge=1, le=MAX_BATCH)
    #: online: P(i ≻ j) = σ((r_i - r_j)/bt_temperature)
    bt_temperature: float = Field(1.0, gt=0, le=MAX_COEFFICIENT)
    #: samples per backward pass (the loss is taken on detached features first, then backpropagated in
    #: chunks of regenerated samples: K samples need not fit in memory with their graphs); None: all K
    chunk: int | None = Field(None, ge=1, le=MAX_BATCH)

    @field_validator("K")
    @classmethod
    def _enough_for_bandwidth(cls, k: int) -> int:
        if k < MIN_K:
            raise ValueError(f"K={k} is too small to set the KDE bandwidth (median of K(K-1)/2 reference "
                             f"distances); use K >= {MIN_K} (the paper's text-to-image runs: 12)")
        return k

    @model_validator(mode="after")
    def _pinned_bandwidth_is_fixed(self) -> "FestDPOConfig":
        if self.bandwidth_h2 is not None and self.bandwidth == "per_step":
            raise ValueError("trainer.bandwidth_h2 pins one h² for the run, but trainer.bandwidth=per_step sets "
                             "one per prompt: use bandwidth=fixed, or drop bandwidth_h2")
        if self.bandwidths is not None and self.bandwidth_h2 is not None:
            raise ValueError("trainer.bandwidths and trainer.bandwidth_h2 both set the kernel: give the h values "
                             "in bandwidths, or one h² in bandwidth_h2")
        if self.bandwidths is not None and self.bandwidth == "per_step":
            raise ValueError("trainer.bandwidths sets the run's kernels, but trainer.bandwidth=per_step sets one per "
                             "prompt: use bandwidth=fixed, or drop bandwidths")
        # an encoder the other features would never load: refuse it rather than ignore it
        if changed(self, "feature_encoder") and self.feature != "encoder":
            raise ValueError(f"trainer.feature_encoder is read only with trainer.feature=encoder (it is "
                             f"{self.feature}): set that, or drop feature_encoder")
        return self


# ---------------------------------------------------------------------------------------------- the loss


def kde_bandwidth(x_ref: torch.Tensor) -> torch.Tensor:
    """Median-heuristic ``h²`` (0-d, detached) from reference features ``(K, D)``."""
    k = x_ref.shape[0]
    if k < 2:
        raise ValueError(f"the bandwidth needs at least 2 reference samples, got {k}")
    x = x_ref.detach().double()
    i, j = torch.triu_indices(k, k, offset=1)
    d2 = (x[i] - x[j]).pow(2).sum(-1)
    return (d2.quantile(0.5) / (2 * math.log(k + 1))).float()


def kde_log_density(y: torch.Tensor, x: torch.Tensor, h2: torch.Tensor | float,
                    exclude: torch.Tensor | None = None) -> torch.Tensor:
    """``log p̂(y)`` ``(M,)`` of points ``y (M, D)`` under the Gaussian KDE of samples ``x (K, D)``.

    ``exclude (M,)``: for each y, the index of a sample left out of its KDE (leave-one-out for a y
    that is itself one of the samples), or -1.
    """
    d2 = (y[:, None, :] - x[None, :, :]).pow(2).sum(-1)  # (M, K); exact, unlike cdist's matmul form
    k = x.shape[0]
    logits = -d2 / (2 * h2)
    if exclude is not None:
        drop = F.one_hot(exclude.clamp(min=0), k).bool() & (exclude >= 0)[:, None]
        logits = logits.masked_fill(drop, float("-inf"))
        count = k - (exclude >= 0).to(logits)
        return torch.logsumexp(logits, dim=1) - torch.log(count)
    return torch.logsumexp(logits, dim=1) - math.log(k)


def festdpo_loss(
    x: torch.Tensor, x_ref: torch.Tensor, y_w: torch.Tensor, y_l: torch.Tensor, h2: torch.Tensor | float,
    beta: float, exclude_w: torch.Tensor | None = None, exclude_l: torch.Tensor | None = None,
    reduction: Literal["mean", "sum"] = "mean",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The paper's Eq. 8 on M pairs ``y_w, y_l (M, D)`` of one prompt: per pair, ``-log σ(r̂(y_w) - r̂(y_l))``
    averaged over the bandwidths; then the mean (or, ``reduction="sum"``, the sum) over the pairs.

    ``x (K, D)``: the policy's features (with gradient); ``x_ref (K, D)``: the reference's from the same
    noises. ``h2``: one h² (a float or 0-d tensor) or several ``(B,)``, one loss each, averaged (App. E.1).
    Only ``x`` carries gradient: ``x_ref``, ``y`` and ``h²`` are detached here whatever is passed.
    ``exclude_*``: leave-one-out indices (see :func:`kde_log_density`), the same for θ and ref.
    """
    # one h² is used as given (a float stays a float), so the single-kernel loss is computed as before
    h2s = list(h2.detach().reshape(-1)) if isinstance(h2, torch.Tensor) and h2.dim() > 0 else \
        [h2.detach() if isinstance(h2, torch.Tensor) else h2]
    x_ref, y_w, y_l = x_ref.detach(), y_w.detach(), y_l.detach()

    def reward(y: torch.Tensor, exclude: torch.Tensor | None, h: torch.Tensor | float) -> torch.Tensor:
        return beta * (kde_log_density(y, x, h, exclude) - kde_log_density(y, x_ref, h, exclude))

    margins = torch.stack([reward(y_w, exclude_w, h) - reward(y_l, exclude_l, h) for h in h2s])  # (B, M)
    per_pair = -F.logsigmoid(margins).mean(0)  # (M,)
    loss = per_pair.sum() if reduction == "sum" else per_pair.mean()
    margin = margins.mean(0)
    # a tied margin (policy = reference, e.g. the first step) ranks neither way: half, not wrong
    accuracy = ((margin > 0).float() + 0.5 * (margin == 0).float()).mean()
    return loss, {"dpo_loss": per_pair.detach().mean(), "margin": margin.detach().mean(),
                  "pref_accuracy": accuracy.detach()}


def bradley_terry_pairs(
    rewards: torch.Tensor, valid: torch.Tensor, generator: torch.Generator, temperature: float, max_pairs: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Labelled pairs among scored samples: indices ``(winners, losers)``, each ``(M,)``, M ≤ max_pairs.

    Pairs (i, j) with both rewards valid and different are drawn in random order; ``i`` wins with
    probability ``σ((r_i - r_j)/temperature)`` (Bradley-Terry sampling). Ties carry no preference and
    are left out [derived].
    """
    n = rewards.shape[0]
    i, j = torch.triu_indices(n, n, offset=1)
    keep = valid[i] & valid[j] & (rewards[i] != rewards[j])
    i, j = i[keep], j[keep]
    order = torch.randperm(i.shape[0], generator=generator)[:max_pairs]
    i, j = i[order], j[order]
    p_i = torch.sigmoid((rewards[i] - rewards[j]).double() / temperature)
    i_wins = torch.rand(i.shape[0], generator=generator, dtype=torch.float64) < p_i
    return torch.where(i_wins, i, j), torch.where(i_wins, j, i)


# ---------------------------------------------------------------------------------------------- hooks


@dataclass
class ChunkUnit:
    """K' of a prompt's common noises ``z``, their conditioning and ``∂L/∂X`` of their features ``(K', D)``."""

    z: torch.Tensor
    cond: Conditioning
    grad: torch.Tensor


@dataclass
class PreferenceBatch:
    """A step's regenerable chunks (prompts with a preference pair only) and its logs."""

    units: list[ChunkUnit]
    prompts_with_pairs: int
    logs: dict[str, Any] = field(default_factory=dict)
    #: this rank's preference pairs (loss_mean=pairs divides the step's loss by every rank's)
    pairs: int = 0


@dataclass
class DrawnPrompt:
    """One prompt's draws of a step, before its pairs: the K noises ``z`` and their conditioning, the
    reference's features ``x_ref (K, D)`` and ``h2``, the policy's samples ``x0 (K, ...)`` and features ``x (K, D)``."""

    prompt: str
    meta: dict
    generator: torch.Generator
    z: torch.Tensor
    cond: Conditioning
    x_ref: torch.Tensor
    h2: torch.Tensor
    x0: torch.Tensor
    x: torch.Tensor


class FestDPOTrainer(GroupTrainer):
    """DPO on the policy's few-step sampler with KDE likelihoods (see the module docstring)."""

    Config = FestDPOConfig
    tcfg: FestDPOConfig

    @classmethod
    def weight_copies(cls, cfg, tcfg) -> list[WeightCopy]:
        """The reference of a full fine-tune: a frozen copy of the starting weights (kept by the loop)."""
        return full_reference(tcfg) if cfg.model.finetune == "full" else []

    @classmethod
    def rollouts_per_step(cls, tcfg: FestDPOConfig) -> tuple[int, int, int]:
        """``K`` samples of the few-step sampler per prompt (its own settings, not an option group's): the
        policy's samples, their noises and conditioning are held until the step's update."""
        return tcfg.prompts_per_step, tcfg.K, tcfg.num_steps

    @classmethod
    def frozen_encoders(cls, tcfg: FestDPOConfig) -> list[FrozenEncoder]:
        """``trainer.feature_encoder`` where the KDEs are computed in its features (``feature: encoder``)."""
        if tcfg.feature != "encoder":
            return []
        e = tcfg.feature_encoder
        return [FrozenEncoder("trainer.feature_encoder", e.name, e.path, e.dtype, dict(e.options))]

    @classmethod
    def check_config(cls, cfg, tcfg: FestDPOConfig) -> None:
        if not tcfg.pairs:  # offline preference pairs carry their own labels: rewards: [] is fine there
            super().check_config(cfg, tcfg)
        if tcfg.feature == "encoder":
            e = tcfg.feature_encoder
            check_encoder_setting("trainer.feature_encoder", e.name, e.path, "trainer.feature=encoder",
                                  "dinov2: facebook/dinov2-base", "trainer.feature=latent_pool")

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        tc = self.tcfg
        self.offline: PromptSet | None = None
        if tc.pairs:
            from flowalign.trainers.parts.pairs import read_preference_pairs

            self.offline = read_preference_pairs(tc.pairs)  # every image checked here, before compute
            if tc.feature != "pixels" and not hasattr(self.policy, "encode_images"):
                raise UserError(f"offline pairs with trainer.feature={tc.feature} need the {self.policy.family} policy "
                                "to encode images (no encode_images): use trainer.feature=pixels")
        latent_ndim = self.policy.initial_noise(1, torch.Generator().manual_seed(0)).ndim - 1
        if tc.feature == "latent_pool" and latent_ndim not in (3, 4):
            raise UserError(f"trainer.feature=latent_pool pools (C,H,W) or (C,F,H,W) latents, but the "
                            f"{self.policy.family} policy's latents have {latent_ndim} dims: use feature=latent or pixels")
        if tc.feature == "encoder" and latent_ndim != 3:
            raise UserError(f"trainer.feature=encoder encodes images, but the {self.policy.family} policy's latents "
                            f"have {latent_ndim} dims (a video): use feature=latent_pool")
        #: the frozen image encoder of feature=encoder (None: the features need no network)
        declared = self.frozen_encoders(tc)
        self.encoder = self.load_encoder(declared[0]) if declared else None
        self._h2: torch.Tensor | None = None

    def load_encoder(self, e: FrozenEncoder) -> Any:
        """The declared encoder ``e`` from its ``encoders`` plugin, frozen on the policy's device."""
        from flowalign.plugins import load_encoder

        encoder = load_encoder(e.name, e.path, setting=e.setting, dtype=e.torch_dtype, **e.options)
        encoder.model.to(self.policy.device)
        return encoder

    # ------------------------------------------------------------------ pieces

    @contextmanager
    def reference(self) -> Iterator[None]:
        """Inside: the policy is the reference (the adapter off, or a full fine-tune's frozen starting weights)."""
        with self.policy.adapter_disabled():
            yield

    def generate(self, z: torch.Tensor, cond: Conditioning) -> torch.Tensor:
        """The few-step sampler ``G(z, c)``: ``num_steps`` Euler steps on the policy's grid → x0 ``(B, ...)``."""
        sigmas = self.policy.sigmas(self.tcfg.num_steps).float()
        guidance = float(self.tcfg.guidance_scale or self.policy.defaults.get("guidance_scale", 1.0))
        x = z
        for k in range(len(sigmas) - 1):
            v = self.policy.velocity(x, sigmas[k].item(), cond, guidance)
            x = euler_step(v, x, sigmas[k].item(), sigmas[k + 1].item()).prev_sample
        return x

    def features(self, x0: torch.Tensor) -> torch.Tensor:
        """ϕ of latents ``(B, ...)`` → ``(B, D)`` float32 (differentiable)."""
        kind, s = self.tcfg.feature, self.tcfg.feature_size
        if kind == "latent":
            return x0.float().flatten(1)
        if kind in ("pixels", "encoder"):
            return self.image_features(self.policy.decode(x0))
        pool = F.adaptive_avg_pool2d if x0.ndim == 4 else F.adaptive_avg_pool3d
        size = s if x0.ndim == 4 else (x0.shape[2], s, s)
        return pool(x0.float(), size).flatten(1)

    def image_features(self, images: torch.Tensor) -> torch.Tensor:
        """ϕ of images ``(B, 3, H, W)`` in [0, 1] (offline pairs) → ``(B, D)``."""
        if self.tcfg.feature == "pixels":
            return F.adaptive_avg_pool2d(images.float(), self.tcfg.feature_size).flatten(1)
        if self.tcfg.feature == "encoder":  # differentiable in the images; the encoder itself is frozen
            return self.encoder.encode_images(images.to(self.policy.device)).float()
        return self.features(self.policy.encode_images(images))

    def bandwidth(self, x_ref: torch.Tensor) -> torch.Tensor:
        """``h²`` for a prompt: this prompt's reference samples, or (``fixed``) one value for the run, or the
        run's ``bandwidths`` squared ``(B,)``."""
        if self.tcfg.bandwidth == "per_step":
            return self.tcfg.bandwidth_scale * kde_bandwidth(x_ref)
        if self._h2 is None:
            if self.tcfg.bandwidths is not None:
                h2 = torch.tensor(self.tcfg.bandwidths, dtype=torch.float64).pow(2).float()
            else:
                h2 = torch.tensor(self.tcfg.bandwidth_h2) if self.tcfg.bandwidth_h2 is not None else self.calibrate_bandwidth()
            self._h2 = self.tcfg.bandwidth_scale * h2
        return self._h2

    @torch.no_grad()
    def calibrate_bandwidth(self) -> torch.Tensor:
        """The run's fixed ``h²``: the median over the first step's prompts of their reference bandwidths.

        A pure function of the frozen reference and the run seed, so a resumed run recomputes the same
        value and every rank gets the same one.
        """
        prompts = self.prompt_source()
        idx = prompts.batch_indices(self.cfg.run.seed, 0, self.tcfg.prompts_per_step)
        values = []
        for gid, i in enumerate(idx):
            z = self.policy.initial_noise(self.tcfg.K, torch.Generator().manual_seed(derived_seed(self.cfg.run.seed, gid, 7)))
            with self.reference():
                x_ref = self.features(self.generate(z, self.policy.encode([prompts.prompts[i]] * self.tcfg.K)))
            values.append(kde_bandwidth(x_ref))
        return torch.stack(values).median()

    def prompt_source(self) -> PromptSet:
        return self.offline if self.offline is not None else self.data

    def preference_pairs(self, x: torch.Tensor, meta: dict, rewards: torch.Tensor | None, valid: torch.Tensor | None,
                         generator: torch.Generator) -> dict[str, torch.Tensor] | None:
        """``y_w, y_l (M, D)`` (+ leave-one-out indices online), or None when the prompt gives no pair. Online:
        drawn among the K samples (features ``x (K, D)``) by their ``rewards`` and ``valid`` ``(K,)``."""
        if self.offline is not None:
            from flowalign.trainers.parts.pairs import load_image

            h, w = int(self.policy.defaults["height"]), int(self.policy.defaults["width"])
            images = torch.stack([load_image(meta[k], h, w) for k in ("chosen", "rejected")]).to(self.policy.device)
            with torch.no_grad():
                y = self.image_features(images)
            return {"y_w": y[:1], "y_l": y[1:]}
        win, lose = bradley_terry_pairs(rewards, valid, generator, self.tcfg.bt_temperature, self.tcfg.pairs_per_prompt)
        if win.numel() == 0:
            return None
        win, lose = win.to(x.device), lose.to(x.device)
        return {"y_w": x[win].detach(), "y_l": x[lose].detach(), "exclude_w": win, "exclude_l": lose}

    # ------------------------------------------------------------------ hooks

    def collect(self, step: int) -> PreferenceBatch:
        """Per prompt: K common noises, the reference's features and h², the policy's samples (no grad); online,
        every prompt's samples scored at once; then each prompt's preference pairs and ``∂L/∂X`` of the DPO
        loss: its sum over the prompt's pairs (``loss_mean: pairs``; :meth:`plan` divides by the step's pair
        count), or its mean divided by the prompts per step (``prompts``)."""
        t0 = time.perf_counter()
        tc = self.tcfg
        source = self.prompt_source()
        p = tc.prompts_per_step
        idx = self.step_indices(step, source)
        drawn: list[DrawnPrompt] = []
        for n, i in enumerate(idx):
            prompt, meta = source.prompts[i], source.metadata[i]
            generator = torch.Generator().manual_seed(derived_seed(self.cfg.run.seed, step, self.rank * p + n))
            z = self.policy.initial_noise(tc.K, generator)
            cond = self.policy.encode([prompt] * tc.K)
            with torch.no_grad(), self.reference():
                x_ref = self.features(self.generate(z, cond))
            h2 = self.bandwidth(x_ref)
            with torch.no_grad():
                x0 = self.generate(z, cond)
                x = self.features(x0)
            drawn.append(DrawnPrompt(prompt, meta, generator, z, cond, x_ref, h2, x0, x))
        rewards = valid = None
        logs: dict[str, Any] = {}
        if self.offline is None:  # offline pairs carry their own labels: no reward
            with torch.no_grad():
                samples = torch.cat([self.policy.decode(d.x0) for d in drawn])
            scored = self.score(samples, [d.prompt for d in drawn for _ in range(tc.K)],
                                [d.meta for d in drawn for _ in range(tc.K)], step=step)
            rewards, valid = scored.scores.total.view(len(drawn), tc.K), scored.scores.valid.view(len(drawn), tc.K)
            logs.update(scored.logs)
        stats: dict[str, list[unit_logs.Logged]] = {}
        units: list[ChunkUnit] = []
        for n, d in enumerate(drawn):
            pairs = self.preference_pairs(d.x, d.meta, None if rewards is None else rewards[n],
                                          None if valid is None else valid[n], d.generator)
            if pairs is None:
                continue
            x = d.x.detach().requires_grad_()
            by_pairs = tc.loss_mean == "pairs"
            loss, info = festdpo_loss(x, d.x_ref, pairs["y_w"], pairs["y_l"], d.h2, tc.dpo_beta,
                                      pairs.get("exclude_w"), pairs.get("exclude_l"), "sum" if by_pairs else "mean")
            (grad,) = torch.autograd.grad(loss if by_pairs else loss / p, x)
            size = tc.chunk or tc.K
            units += [ChunkUnit(d.z[s : s + size], d.cond[s : s + size], grad[s : s + size]) for s in range(0, tc.K, size)]
            for k, v in {**info, "h2": float(d.h2.mean()), "pairs": float(pairs["y_w"].shape[0])}.items():
                stats.setdefault(k, []).append(v)
        used = len(stats.get("pairs", []))  # prompts that gave a preference pair
        count = int(sum(stats.get("pairs", [])))
        logs.update({**{f"train/{k}": v for k, v in unit_logs.merged(stats).items()},
                     "train/prompts_with_pairs": float(used), "time/sample": time.perf_counter() - t0})
        return PreferenceBatch(units, used, logs, count)

    def plan(self, batch: PreferenceBatch, generator: torch.Generator) -> Plan:
        """One optimiser step over every regenerated chunk, or none when no prompt on any rank gave a
        preference (weight decay alone would move the weights)."""
        # every rank must take the same branch (the optimiser step reduces gradients)
        if not self.total(batch.prompts_with_pairs):
            return Plan([])
        if self.tcfg.loss_mean == "prompts":
            return Plan([batch.units])
        # Eq. 8's expectation over pairs: each unit carries its prompts' summed-loss gradient, divided here by
        # the step's pairs on every rank, and the ranks' gradients are summed (global weights)
        pairs = self.total(batch.pairs)
        return Plan([[ChunkUnit(u.z, u.cond, u.grad / pairs) for u in batch.units]], global_weights=True)

    def loss(self, batch: PreferenceBatch, unit: ChunkUnit) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``⟨ϕ(G_θ(z, c)), ∂L/∂X⟩``: its gradient in θ is the chunk's share of the DPO loss's."""
        return (self.features(self.generate(unit.z, unit.cond)) * unit.grad).sum(), {}
