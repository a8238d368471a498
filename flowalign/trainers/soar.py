"""SOAR (arXiv 2604.12617): reward-free self-correction on real (image, caption) pairs; SFT is λ = 0.

Read against ``docs/methods/soar.md``; by default it computes what the authors' training script computes
(Tencent-Hunyuan/HY-SOAR 59f0e02, ``soar/train_soar_sd3_5m.py`` with ``soar/utils/algorithm.py``). Per pair
(x0, c), with t ~ logit-normal and the scheduler's training grid (shift applied,
:mod:`flowalign.trainers.parts.training_grid`):

    σ = grid(t),  σ' = grid(max(t - 1/K, 0)),  x_σ = (1-σ)·x0 + σ·ε          (on-trajectory state)
    x̂ = x_σ + (σ'-σ)·v̂,  v̂ = CFG(w_cfg) of the current model, no gradient      (one rollout step)
    σ̃_j = σ' + u_j·(1-σ'),  a_j = (σ̃_j-σ')/(1-σ'),  z_j = (1-a_j)·x̂ + a_j·ε     (re-noise toward the same ε)
    v*_j = (z_j - x0)/σ̃_j                                                        (lands exactly on x0)
    L = (Σ_i ‖v_θ(x_σ,σ,c) - (ε - x0)‖²_i + λ·Σ_{j,i} ‖v_θ(z_j,grid_of(σ̃_j),c) - sg(v*_j)‖²_i) / (B + λ·N·B)

With ``rollout_paths`` M > 1 the same v̂ also takes M - 1 stochastic steps (``path_sampler``) from x_σ, each
x̂ with its own N points, for the pairs whose step does not land on t = 0; the count divides by all points.
‖·‖²_i is a pair's mean over its elements; the model runs a correction state at the grid level the script
maps σ̃ to (``grid_of``), the state and target use σ̃ itself. ``noise_levels: continuous`` (σ = t, σ' =
max(σ - 1/K, 0), the model at σ̃), ``sigma_min`` (a floor under σ̃ in the target) and ``loss_average: terms``
(L = mean base + λ·mean correction) give the form this trainer had before.

The options name the symbols: K = ``rollout_steps``, w_cfg = ``rollout_guidance``, N = ``corrections``,
λ = ``correction_weight``. The loop is the shared one (checkpoints, resume, EMA, evaluation, logging); the
hooks: ``collect`` draws the step's ``pairs_per_step`` pairs with their noise and levels (no rollout
group, no reward: ``rewards: []`` is accepted), ``plan`` splits them into batches of ``batch_size`` pairs
(one optimiser step), ``loss`` is :func:`soar_loss` of a batch. Pairs come from ``trainer.pairs`` (a folder
or JSONL of image + caption) or, for a benchmark of programmatic scenes (``data.bench: vvr``), from
rendering each training task at the model's resolution (``vvr_edit``: the edited result, the task's input
image conditioning an editing model). A pair's caption dropout, ε, t and u draws are keyed by its place
in the step's global draw, as a rollout's noise is, so N ranks draw what one process draws.
[derived] choices: the N corrections of a pair share its x̂ and run as one batched pass (the script runs
them one by one: the same sum), and the u draws use their own generator so that the (ε, t) of a step do
not depend on N or λ.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from pydantic import Field, model_validator

from flowalign.config import changed
from flowalign.errors import UserError
from flowalign.limits import (MAX_BATCH, MAX_CACHE, MAX_COEFFICIENT, MAX_GUIDANCE, MAX_LOGIT, MAX_LR, MAX_SAMPLING_STEPS,
                              MAX_UPDATES)
from flowalign.protocols import Conditioning
from flowalign.sampling.inputs import encode_prompts
from flowalign.sampling.steps import cps_moments, flow_sde_moments
from flowalign.trainers.base import GroupTrainer, Plan, derived_seed
from flowalign.trainers.options import TrainerConfig
from flowalign.trainers.parts.diffsynth_levels import LEVELS, TrainingLevels, diffsynth_flux2_levels, weighted_errors
from flowalign.trainers.parts.pair_images import PairImages
from flowalign.trainers.parts.training_grid import grid_sigma, grid_sigma_of, training_grid

Velocity = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class SOARConfig(TrainerConfig):
    """Real (image, caption) pairs: no rollout groups, no rewards, no advantages."""

    #: ``micro_batch`` is the former ``batch_size`` (pairs per forward/backward), read by ``_former_micro_batch``
    #: (which runs first: it also moves the former ``batch_size``, pairs per step, to ``pairs_per_step``)
    renamed = {"K": "rollout_steps", "w_cfg": "rollout_guidance", "N": "corrections", "lam": "correction_weight",
               "micro_batch": "batch_size"}

    name: Literal["soar"] = "soar"
    #: what runs saved before these options existed computed (see TrainerConfig.before)
    before = {"noise_levels": "continuous", "sigma_min": 0.05, "loss_average": "terms", "image_latents": "mean",
              "caption_dropout_per": "pair"}
    #: AdamW rate: the authors' 2e-5 (constant, no warm-up)
    lr: float = Field(2e-5, gt=0, le=MAX_LR)
    #: K: the rollout step is 1/K in training time (match the inference step count; the authors' 40)
    rollout_steps: int = Field(40, ge=1, le=MAX_SAMPLING_STEPS)
    #: w_cfg: CFG scale of the stop-gradient rollout step
    rollout_guidance: float = Field(4.5, ge=1, le=MAX_GUIDANCE)
    #: N: re-noised correction states per pair (the authors' trajectory_length 6)
    corrections: int = Field(6, ge=0, le=MAX_UPDATES)
    #: λ: weight of the correction loss (0: plain flow-matching SFT)
    correction_weight: float = Field(1.0, ge=0, le=MAX_COEFFICIENT)
    #: M: rollout paths per pair, each with its own N correction points: the ODE step and M - 1 stochastic
    #: steps from the same state and velocity (the authors' num_rollout_paths; their default 1, ODE only)
    rollout_paths: int = Field(1, ge=1, le=MAX_UPDATES)
    #: the stochastic paths' step (the authors' sde_rollout_type): flow_sde (Flow-GRPO's reverse SDE), cps,
    #: sde (a fresh re-noising of the clean prediction) or simple (Euler plus additive noise)
    path_sampler: Literal["flow_sde", "cps", "sde", "simple"] = "flow_sde"
    #: the stochastic steps' noise scale (the authors' sde_noise_scale); sde ignores it, as theirs
    path_noise_level: float = Field(0.5, ge=0, le=MAX_COEFFICIENT)
    #: scheduler_grid: t → the scheduler's shifted 1000-level grid, as the authors' script (σ never 0);
    #: continuous: σ = t unshifted, σ' = max(σ - 1/K, 0), the model run at σ̃ itself (the former form)
    noise_levels: Literal["scheduler_grid", "continuous"] = "scheduler_grid"
    #: a floor under σ̃ in the target's denominator; None: none, as the authors (the grid keeps σ̃ ≥ σ(1/T))
    sigma_min: float | None = Field(None, gt=0, le=1)
    #: points: every base pair and every correction point weighted alike, (Σ base + λ·Σ corr)/(B + λ·N·B),
    #: as the authors; terms: mean base + λ·mean correction (the former form: corrections weigh 1/N as much)
    loss_average: Literal["points", "terms"] = "points"
    #: t = sigmoid(logit_mean + logit_std·n), n ~ N(0,1) (SD3's training density)
    logit_mean: float = Field(0.0, ge=-MAX_LOGIT, le=MAX_LOGIT)
    logit_std: float = Field(1.0, gt=0, le=MAX_LOGIT)
    #: fraction of captions replaced by "" (keeps the unconditional branch that CFG needs)
    caption_dropout: float = Field(0.0, ge=0, lt=1)
    #: what one dropout draw decides: a training batch's captions, all or none (the authors' cond_dropout_rate),
    #: or each pair's caption on its own
    caption_dropout_per: Literal["batch", "pair"] = "batch"
    #: a folder of images with .txt captions or a JSONL of {"image", "prompt"}; None: render data.bench tasks
    pairs: str | None = None
    #: pairs per optimiser step on each rank; None: batch_size (one forward/backward per step)
    pairs_per_step: int | None = Field(None, ge=1, le=MAX_BATCH)
    #: pairs per forward/backward, the training batch (gradients accumulate over a step's batches)
    batch_size: int = Field(8, ge=1, le=MAX_BATCH)
    #: latents kept in memory (encoding a pair once per run, not once per epoch)
    latent_cache: int = Field(50000, ge=1, le=MAX_CACHE)
    #: a pair's clean latent x0: "sample", a fresh draw from the VAE's posterior each time the pair is trained
    #: (the authors' latent_dist.sample() at every step; its mean and std are cached), or "mean", the
    #: posterior's mean (the former form)
    image_latents: Literal["sample", "mean"] = "sample"

    @model_validator(mode="before")
    @classmethod
    def _former_micro_batch(cls, data: Any) -> Any:
        """``micro_batch`` (pairs per forward/backward) came with ``batch_size`` meaning pairs per step; both
        are read in that sense, and said once."""
        if not isinstance(data, dict) or "micro_batch" not in data:
            return data
        if "pairs_per_step" in data:
            raise ValueError("trainer.micro_batch is the former trainer.batch_size: with trainer.pairs_per_step, "
                             "give the pairs per forward/backward as trainer.batch_size")
        data = dict(data)
        micro = data.pop("micro_batch")
        per_step = data.pop("batch_size", cls.model_fields["batch_size"].default)
        data.update(pairs_per_step=per_step, batch_size=per_step if micro is None else micro)
        print(f"warning: trainer.micro_batch is deprecated and will be removed: write trainer.pairs_per_step: {per_step} "
              f"(pairs per step, formerly batch_size) and trainer.batch_size: {data['batch_size']} (pairs per "
              "forward/backward, formerly micro_batch)")
        return data

    @model_validator(mode="after")
    def _continuous_levels_need_a_floor(self) -> "SOARConfig":
        # continuous levels reach σ' = 0 and u = 0 gives σ̃ = 0: the target (z - x0)/σ̃ would divide by zero
        if self.noise_levels == "continuous" and self.corrections > 0 and self.sigma_min is None:
            raise ValueError("trainer.noise_levels=continuous reaches σ̃ = 0: set trainer.sigma_min (e.g. 0.05, "
                             "its former default) or use trainer.noise_levels=scheduler_grid")
        # the flow_sde step's σ = 1 substitute is the grid's second level: continuous levels have no grid
        if self.rollout_paths > 1 and self.noise_levels == "continuous":
            raise ValueError("trainer.rollout_paths > 1 steps on the scheduler's grid: set "
                             "trainer.noise_levels=scheduler_grid or trainer.rollout_paths=1")
        return self

    @property
    def step_pairs(self) -> int:
        """Pairs per optimiser step on each rank."""
        return self.pairs_per_step or self.batch_size


class SFTConfig(SOARConfig):
    """Plain flow-matching SFT: SOAR with λ = 0 and no correction passes."""

    name: Literal["sft"] = "sft"  # type: ignore[assignment]
    correction_weight: float = Field(0.0, ge=0, le=0)
    corrections: int = Field(0, ge=0, le=0)
    #: the training levels: "logit_normal", t from logit_mean / logit_std on the scheduler's grid (noise_levels);
    #: "diffsynth_flux2", DiffSynth-Studio's FlowMatchSFTLoss with its FLUX.2 scheduler (the CrossTimeEdit
    #: authors' SFT): one of its 1000 shifted levels drawn uniformly, the error weighted by its training weight
    #: (flowalign.trainers.parts.diffsynth_levels)
    timesteps: Literal["logit_normal", "diffsynth_flux2"] = "logit_normal"

    @model_validator(mode="after")
    def _one_form_of_levels(self) -> "SFTConfig":
        if self.timesteps == "diffsynth_flux2":
            given = [o for o in ("logit_mean", "logit_std", "noise_levels") if changed(self, o)]
            if given:
                raise ValueError(f"trainer.{given[0]} sets the logit-normal levels, which trainer.timesteps="
                                 "diffsynth_flux2 does not read: drop it or set trainer.timesteps=logit_normal")
        return self


# ---------------------------------------------------------------------------------------------- the math


def sample_sigmas(n: int, generator: torch.Generator, mean: float = 0.0, std: float = 1.0) -> torch.Tensor:
    """``(n,)`` training times from the logit-normal density of SD3 (1 = noise)."""
    return torch.sigmoid(mean + std * torch.randn(n, generator=generator))


def rollout_levels(t: torch.Tensor, K: int, grid: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """A pair's noise level σ and the rollout step's σ', both ``(B,)`` in ``t``'s dtype, from training times
    ``t (B,)``: the step is 1/K in training time, ``t' = max(t - 1/K, 0)``; with the scheduler's ``grid``
    ``(T,)`` both are grid levels (:func:`grid_sigma`: shifted, never 0), without it σ = t and σ' = t'."""
    t_next = (t - 1.0 / K).clamp(min=0.0)
    if grid is None:
        return t, t_next
    return grid_sigma(t, grid), grid_sigma(t_next, grid)


def _col(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A per-sample ``(B,)`` value broadcast against ``(B, ...)``, in ``like``'s dtype."""
    return t.to(like).reshape(-1, *([1] * (like.ndim - 1)))


@torch.no_grad()
def rollout_velocity(guided: Velocity, x_sigma: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """``v̂ (B, ...)``: the current model's guided velocity at the on-trajectory state, without gradient."""
    return guided(x_sigma, sigma)


def off_trajectory_state(v_hat: torch.Tensor, x_sigma: torch.Tensor, sigma: torch.Tensor, sigma_next: torch.Tensor) -> torch.Tensor:
    """The ODE path: one Euler step of ``v̂`` from ``x_σ``, ``x̂ (B, ...)`` at ``σ' (B,)``."""
    # σ' and σ cast before the difference, as the authors' step does: the same bits in float64
    return x_sigma + v_hat * (_col(sigma_next, x_sigma) - _col(sigma, x_sigma))


@dataclass
class StochasticPaths:
    """The M - 1 stochastic rollout paths of a batch (``rollout_paths``): the step ``kind`` with noise scale
    ``eta``, each path's noise ``(M-1, B, ...)`` and correction draws ``u (M-1, N, B)``, and ``active (B,)``,
    the pairs that take them (a pair whose rollout step lands on t = 0 keeps its ODE path only, as the
    authors'). ``sigma_max``: the training grid's second level, where the flow_sde step reads σ = 1."""

    kind: str
    eta: float
    noise: torch.Tensor
    u: torch.Tensor
    active: torch.Tensor
    sigma_max: float

    def __getitem__(self, part: slice) -> "StochasticPaths":
        """The paths of a micro-batch ``part`` of the pairs."""
        return StochasticPaths(self.kind, self.eta, self.noise[:, part], self.u[:, :, part], self.active[part],
                               self.sigma_max)


def stochastic_path_state(
    kind: str, v_hat: torch.Tensor, x_sigma: torch.Tensor, sigma: torch.Tensor, sigma_next: torch.Tensor,
    noise: torch.Tensor, *, eta: float, sigma_max: float,
) -> torch.Tensor:
    """One stochastic rollout step ``x̂ (B, ...)`` from ``x_σ`` with ``v̂`` and standard normal ``noise``, in
    float32, returned in ``x_σ``'s dtype (the authors' ``stochastic_rollout_step``):

    - ``flow_sde``: Flow-GRPO's reverse-SDE step with ``s = η·sqrt(σ/(1-σ))``, σ = 1 read as ``sigma_max``;
    - ``cps``: coefficients-preserving sampling with η;
    - ``sde``: ``(1-σ')·(x - σ·v̂) + σ'·noise``, a fresh re-noising of the clean prediction (CPS at η = 1);
    - ``simple``: the Euler step plus ``η·sqrt(σ - σ')·noise``.
    """
    v, x = v_hat.float(), x_sigma.float()
    if kind == "flow_sde":
        safe = torch.where(sigma == 1, torch.full_like(sigma, sigma_max), sigma)
        s = eta * torch.sqrt(sigma / (1 - safe))
        mean, std = flow_sde_moments(v, x, sigma, sigma_next, diffusion=s)
    elif kind in ("cps", "sde"):
        mean, std = cps_moments(v, x, sigma, sigma_next, eta=1.0 if kind == "sde" else eta)
    elif kind == "simple":
        dt = _col(sigma_next, x) - _col(sigma, x)
        mean, std = x + v * dt, eta * torch.sqrt(dt.abs())
    else:
        raise ValueError(f"unknown path_sampler {kind!r}: choose flow_sde, cps, sde or simple")
    return (mean + std * noise.float()).to(x_sigma.dtype)


def correction_targets(
    x0: torch.Tensor, eps: torch.Tensor, x_hat: torch.Tensor, sigma_prime: torch.Tensor, sigma_tilde: torch.Tensor,
    sigma_min: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Re-noised states ``z`` and targets ``v*``, both ``(N, B, ...)``, for ``σ̃ (N, B)`` in ``[σ', 1]`` from the
    rollout state ``x̂``: ``(B, ...)``, shared by the N points, or ``(N, B, ...)``, one for each.

    ``z = (1-a)·x̂ + a·ε`` with ``a = (σ̃-σ')/(1-σ')``: the straight line from x̂ back toward the *same* ε, so
    for an exact x̂ the state is on the data's own path and ``v* = (z - x0)/σ̃ = ε - x0``. ``a`` is formed in
    the levels' dtype (float32 in training, as the authors'); ``sigma_min`` floors σ̃ in the denominator.
    """
    a = ((sigma_tilde - sigma_prime[None]) / (1.0 - sigma_prime[None]).clamp(min=1e-8)).clamp(0.0, 1.0)
    shape = (*sigma_tilde.shape, *([1] * (x0.ndim - 1)))
    a = a.to(x0).reshape(shape)
    z = (1.0 - a) * (x_hat if x_hat.ndim > x0.ndim else x_hat[None]) + a * eps[None]
    denom = sigma_tilde if sigma_min is None else sigma_tilde.clamp(min=sigma_min)
    return z, (z - x0[None]) / denom.to(x0).reshape(shape)


def per_pair_mse(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``(B,)`` each row's mean of ``(a - b)²`` over its elements."""
    return (a - b).pow(2).flatten(1).mean(1)


def mse(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``mean‖a - b‖²``: per-sample mean over the non-batch elements, then over the batch."""
    return per_pair_mse(a, b).mean()


def soar_loss(
    velocity: Velocity, guided: Velocity, x0: torch.Tensor, eps: torch.Tensor, sigma: torch.Tensor,
    sigma_next: torch.Tensor, u: torch.Tensor, *, lam: float, sigma_min: float | None = None,
    model_sigma: Callable[[torch.Tensor], torch.Tensor] | None = None, average: str = "points",
    rollout: Callable = off_trajectory_state, paths: StochasticPaths | None = None,
    count: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The SOAR loss of a batch of pairs (``N = u.shape[0]`` corrections; N = 0 is plain SFT).

    ``velocity(x, σ)`` is the trained model's conditional velocity (with gradient) for a batch of ``B``
    or ``k·B`` states (j-major); ``guided(x, σ)`` its CFG velocity for the rollout step. ``x0, eps``:
    ``(B, ...)``; ``sigma, sigma_next (B,)`` from :func:`rollout_levels`; ``u (N, B)`` uniform draws that
    place ``σ̃ = σ' + u·(1-σ')`` on the ODE path; ``paths``: the stochastic paths, each with its own N points
    (their states are run for every pair, the inactive pairs' errors weighted 0). ``model_sigma``: the
    level the model runs a correction state at (the scheduler grid's :func:`grid_sigma_of`; None: σ̃).
    ``average``: ``points`` divides the summed per-pair errors, corrections weighted λ, by ``count``
    (default this batch's own ``B + λ·(N·B + (M-1)·N·R)``, R the pairs on stochastic paths; the authors'
    is the step's over every rank); ``terms`` is mean base + λ·mean correction. ``rollout``: how x̂ is made
    from ``v̂`` (:func:`off_trajectory_state`; a test swaps in a detached clone).
    """
    x_sigma = (1 - _col(sigma, x0)) * x0 + _col(sigma, x0) * eps
    base = per_pair_mse(velocity(x_sigma, sigma), eps - x0)
    info = {"loss_base": base.mean().detach()}
    b = x0.shape[0]
    if u.shape[0] == 0:
        return base.sum() / (b if count is None else count) if average == "points" else base.mean(), info
    v_hat = rollout_velocity(guided, x_sigma, sigma)
    x_hat = rollout(v_hat, x_sigma, sigma, sigma_next)
    states, draws, weights = [x_hat], [u], [torch.ones_like(u)]
    if paths is not None:
        for noise, path_u in zip(paths.noise, paths.u):
            states.append(stochastic_path_state(paths.kind, v_hat, x_sigma, sigma, sigma_next, noise, eta=paths.eta,
                                                sigma_max=paths.sigma_max))
            draws.append(path_u)
            weights.append(paths.active[None].to(u).expand_as(path_u))
    x_hats, u_all, weight = torch.stack(states), torch.cat(draws), torch.cat(weights)  # (M, B, ...), (M·N, B) ×2
    n = u.shape[0]
    sigma_tilde = sigma_next[None] + u_all * (1 - sigma_next[None])
    z, v_star = correction_targets(x0, eps, x_hats.repeat_interleave(n, 0), sigma_next, sigma_tilde, sigma_min)
    k = sigma_tilde.shape[0]
    at = sigma_tilde.reshape(-1) if model_sigma is None else model_sigma(sigma_tilde.reshape(-1))
    corr = per_pair_mse(velocity(z.reshape(k * b, *x0.shape[1:]), at), v_star.detach().reshape(k * b, *x0.shape[1:]))
    # a pair off its stochastic paths adds nothing (where, not a product: no 0·inf)
    corr = torch.where(weight.reshape(-1) > 0, corr, torch.zeros_like(corr))
    points = weight.sum()
    info["loss_corr"] = (corr.sum() / points).detach()
    # the rollout error e = x̂ - x̂_on on the ODE path: the part of the target SFT does not see
    on = (1 - _col(sigma_next, x0)) * x0 + _col(sigma_next, x0) * eps
    info["rollout_error"] = (x_hat - on).detach().flatten(1).norm(dim=1).mean()
    if average == "points":
        return (base.sum() + lam * corr.sum()) / ((b + lam * points) if count is None else count), info
    return base.mean() + lam * corr.sum() / points, info


def cost_per_pair(N: int, w_cfg: float, paths: int = 1) -> tuple[int, int]:
    """Transformer work per pair and step: ``(sample-passes, units)`` with a forward = 1 unit and a
    forward + backward = 3: base (3) + the no-grad rollout step (1, or 2 with CFG) + N corrections on each
    of the ``paths`` (3 each). SOAR at N=4 with CFG costs 17 units to SFT's 3, so SFT gets 17/3 as many
    steps at equal compute."""
    if N == 0:
        return 1, 3
    rollout = 2 if w_cfg > 1 else 1
    return 1 + rollout + N * paths, 3 + rollout + 3 * N * paths


# ---------------------------------------------------------------------------------------------- hooks


@dataclass
class PairBatch:
    """A step's (image, caption) pairs: clean latents ``x0``, noise ``eps`` ``(B, ...)``, the noise level
    ``sigma`` and the rollout step's ``sigma_next`` ``(B,)`` (float32), the ODE path's correction draws ``u``
    ``(N, B)``, the stochastic ``paths`` (None: the ODE path only), the captions' conditioning, ``count``,
    this rank's share of the step's divisor of the ``points`` average (summed over ranks, divided by their
    number), and the step's logs."""

    x0: torch.Tensor
    eps: torch.Tensor
    sigma: torch.Tensor
    sigma_next: torch.Tensor
    u: torch.Tensor
    cond: Conditioning
    count: float
    paths: StochasticPaths | None = None
    logs: dict[str, float] = field(default_factory=dict)
    #: SFT's ``timesteps: diffsynth_flux2`` levels (the model's σ and the error's weight; ``sigma`` is the state's)
    levels: TrainingLevels | None = None


class SOARTrainer(GroupTrainer):
    """Flow-matching on (image, caption) pairs with SOAR's self-correction term; no rollouts, no reward."""

    Config = SOARConfig
    tcfg: SOARConfig
    needs_rewards = False

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        tc = self.tcfg
        self.images = PairImages(self.policy, self.cfg, self.data, tc.pairs, tc.name, tc.latent_cache,
                                 posterior=tc.image_latents == "sample")
        self.pairs = self.images.pairs
        #: the scheduler's training levels (T,) float32; None: continuous levels
        self.grid = training_grid(self.policy) if tc.noise_levels == "scheduler_grid" else None
        if tc.corrections > 0 and tc.rollout_guidance > 1 and float(self.policy.defaults.get("guidance_scale", 1)) <= 1:
            raise UserError(f"trainer.rollout_guidance={tc.rollout_guidance} needs CFG negatives, but the model's "
                            f"guidance_scale is {self.policy.defaults.get('guidance_scale')}: set "
                            "model.defaults.guidance_scale > 1 or trainer.rollout_guidance=1")
        inference_steps = self.cfg.eval.num_steps or self.policy.defaults.get("num_steps")
        if tc.corrections > 0 and inference_steps and int(inference_steps) != tc.rollout_steps and self.acc.is_main_process:
            # not an error: a run may train for one sampler and be judged with another on purpose
            print(f"warning: trainer.rollout_steps={tc.rollout_steps} but the model samples with {inference_steps} "
                  "steps; SOAR corrects the one-step error of a K-step sampler, so "
                  f"trainer.rollout_steps={inference_steps} trains for that sampler")
        self.latents(self.step_pairs(0)[:1])  # one pair end to end: bad data fails before training

    @classmethod
    def training_batch(cls, tcfg: SOARConfig) -> int:
        """States one training forward holds activations for: a batch's pairs and their N correction states
        on each of the M paths (one loss, one backward)."""
        return tcfg.batch_size * (1 + tcfg.corrections * tcfg.rollout_paths)

    @property
    def encoded(self):
        """The cache of encoded pairs (see :class:`PairImages`)."""
        return self.images.encoded

    def latents(self, indices: list[int]) -> torch.Tensor:
        """``(B, C, h, w)`` clean latents of the pairs (the posterior means), encoded once each and cached."""
        return self.images.latents(indices)

    def clean_latents(self, step: int, indices: list[int]) -> torch.Tensor:
        """``x0 (B, C, h, w)`` of this rank's pairs at ``step``: the posterior's mean, or (``image_latents:
        sample``) ``mean + std·ξ`` with ξ keyed by the pair's place ``j`` in the step's global draw."""
        if self.tcfg.image_latents == "mean":
            return self.latents(indices)
        mean, std = self.images.posteriors(indices)
        first = self.rank * self.tcfg.step_pairs
        xi = torch.stack([torch.randn(mean.shape[1:], generator=torch.Generator().manual_seed(
            derived_seed(self.cfg.run.seed, step, j, 4))) for j in range(first, first + len(indices))])
        return mean + std * xi.to(mean, non_blocking=True)

    def step_pairs(self, step: int) -> list[int]:
        """This rank's pairs of a step, as indices into :attr:`pairs`."""
        return self.step_indices(step, self.pairs, self.tcfg.step_pairs)

    def collect(self, step: int) -> PairBatch:
        """This rank's pairs of the step, their captions (some dropped), ε, t (→ σ, σ') and the correction
        draws, each pair's from generators keyed by its place ``j`` in the step's global draw."""
        t0 = time.perf_counter()
        tc = self.tcfg
        indices = self.step_pairs(step)
        x0 = self.clean_latents(step, indices)
        first = self.rank * tc.step_pairs
        extra = tc.rollout_paths - 1 if tc.corrections > 0 else 0  # stochastic paths a pair may take
        keep, eps, t, u, path_u, path_noise = [], [], [], [], [], []
        for j in range(first, first + len(indices)):
            generator = torch.Generator().manual_seed(derived_seed(self.cfg.run.seed, step, j, 2))
            keep.append(bool(torch.rand(1, generator=generator) >= tc.caption_dropout))
            eps.append(torch.randn(x0.shape[1:], generator=generator))
            t.append(sample_sigmas(1, generator, tc.logit_mean, tc.logit_std))
            # σ̃ draws from their own stream: SOAR and SFT see the same (ε, t) at every step, and the ODE
            # path the same σ̃ whatever the number of paths
            u_gen = torch.Generator().manual_seed(derived_seed(self.cfg.run.seed, step, j, 3))
            u.append(torch.rand(tc.corrections, generator=u_gen))
            if extra:
                path_u.append(torch.rand(extra, tc.corrections, generator=u_gen))
                path_gen = torch.Generator().manual_seed(derived_seed(self.cfg.run.seed, step, j, 6))
                path_noise.append(torch.randn(extra, *x0.shape[1:], generator=path_gen))
        if tc.caption_dropout_per == "batch":  # one draw a training batch, keyed by its first pair's place
            keep = [self.keeps_batch_captions(step, first + n // tc.batch_size * tc.batch_size)
                    for n in range(len(indices))]
        prompts = [self.pairs.prompts[i] if k else "" for i, k in zip(indices, keep)]
        # an editing benchmark's pair: its input image (metadata "image") conditions, its rendered result is x0
        metadata = [self.pairs.metadata[i] for i in indices] if self.images.bench else [{} for _ in indices]
        cond = encode_prompts(self.policy, prompts, metadata)
        passes, units = (c * len(indices) * self.world
                         for c in cost_per_pair(tc.corrections, tc.rollout_guidance, tc.rollout_paths))
        logs = {"cost/forward_passes": passes, "cost/units_total": units * (step + 1),
                "time/data": time.perf_counter() - t0}
        # levels in float32 on the CPU, as the authors' script forms them (the grid index is float32 arithmetic)
        t = torch.cat(t)
        sigma, sigma_next = rollout_levels(t, tc.rollout_steps, self.grid)
        points_per_pair = tc.correction_weight * tc.corrections
        count = len(indices) * (1 + points_per_pair)
        paths = None
        if extra:
            active = (t - 1.0 / tc.rollout_steps) > 0  # the authors' t1 > 0: a step to t = 0 takes no path
            # the authors divide by the step's points over every rank: one collective a step
            count += points_per_pair * extra * self.total(int(active.sum())) / self.world
            paths = StochasticPaths(tc.path_sampler, tc.path_noise_level, torch.stack(path_noise, 1).to(x0),
                                    torch.stack(path_u, 2).to(x0.device), active.to(x0.device), float(self.grid[1]))
            logs["train/stochastic_pairs"] = float(active.float().mean())
        return PairBatch(x0, torch.stack(eps).to(x0), sigma.to(x0.device), sigma_next.to(x0.device),
                         torch.stack(u, 1).to(x0.device), cond, count, paths, logs)

    def keeps_batch_captions(self, step: int, first: int) -> bool:
        """Whether the training batch whose first pair is at place ``first`` of the step's draw keeps its
        captions (``caption_dropout_per: batch``)."""
        generator = torch.Generator().manual_seed(derived_seed(self.cfg.run.seed, step, first, 5))
        return bool(torch.rand(1, generator=generator) >= self.tcfg.caption_dropout)

    def plan(self, batch: PairBatch, generator: torch.Generator) -> Plan:
        """One optimiser step over the pairs, in batches of ``batch_size``."""
        n, size = batch.x0.shape[0], self.tcfg.batch_size
        return Plan([[slice(s, s + size) for s in range(0, n, size)]])

    def loss(self, batch: PairBatch, part: slice) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The SOAR loss of a micro-batch, weighted by its share of the batch."""
        tc = self.tcfg
        cond = batch.cond[part]
        x0 = batch.x0[part]
        grid = None if self.grid is None else self.grid.to(x0.device, non_blocking=True)
        loss, info = soar_loss(self.velocity(cond, 1.0), self.velocity(cond, tc.rollout_guidance), x0,
                               batch.eps[part], batch.sigma[part], batch.sigma_next[part], batch.u[:, part],
                               lam=tc.correction_weight, sigma_min=tc.sigma_min, average=tc.loss_average,
                               model_sigma=None if grid is None else lambda s: grid_sigma_of(s, grid),
                               paths=None if batch.paths is None else batch.paths[part], count=batch.count)
        # points: the micro-batch's sum is divided by the step's count already; terms: weighted by its pairs
        share = x0.shape[0] / batch.x0.shape[0]
        info["loss"] = (loss / share if tc.loss_average == "points" else loss).detach()  # on the step's scale
        return loss if tc.loss_average == "points" else loss * share, info

    def velocity(self, cond: Conditioning, guidance: float) -> Velocity:
        """``v(x, σ)`` for a batch of ``B`` states or ``n·B`` (j-major) sharing ``cond``'s B captions."""

        def v(x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
            c = cond if x.shape[0] == len(cond) else Conditioning.cat([cond] * (x.shape[0] // len(cond)))
            return self.policy.velocity(x, sigma, c, guidance)

        return v


class SFTTrainer(SOARTrainer):
    """Plain flow-matching SFT on the same pairs, noise and σ draws as SOAR (λ = 0, no correction passes); with
    ``timesteps: diffsynth_flux2``, DiffSynth-Studio's levels and weights instead of σ."""

    Config = SFTConfig
    tcfg: SFTConfig

    def collect(self, step: int) -> PairBatch:
        """SOAR's pairs and noise; under ``diffsynth_flux2`` each pair's level index drawn uniformly from a
        stream of its own (keyed by its place in the step's global draw), read as DiffSynth reads it in the
        model's dtype."""
        batch = super().collect(step)
        if self.tcfg.timesteps != "diffsynth_flux2":
            return batch
        first = self.rank * self.tcfg.step_pairs
        index = torch.cat([torch.randint(0, LEVELS, (1,), generator=torch.Generator().manual_seed(
            derived_seed(self.cfg.run.seed, step, j, 8))) for j in range(first, first + batch.x0.shape[0])])
        levels = diffsynth_flux2_levels(index, self.policy.dtype)
        device = batch.x0.device
        batch.levels = TrainingLevels(*(t.to(device, non_blocking=True) for t in (levels.sigma, levels.model_sigma,
                                                                               levels.weight)))
        batch.sigma = batch.sigma_next = batch.levels.sigma
        return batch

    def loss(self, batch: PairBatch, part: slice) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """DiffSynth's FlowMatchSFTLoss of a micro-batch: ``w·mean‖v(x_σ, σ_model) − (ε − x0)‖²`` per pair, summed
        over the step's pairs and divided by their count (its micro-batches' mean)."""
        if batch.levels is None:
            return super().loss(batch, part)
        x0, levels = batch.x0[part], batch.levels
        part_levels = TrainingLevels(levels.sigma[part], levels.model_sigma[part], levels.weight[part])
        weighted, error = weighted_errors(self.velocity(batch.cond[part], 1.0), x0, batch.eps[part], part_levels)
        loss = weighted.sum() / batch.count if self.tcfg.loss_average == "points" else weighted.mean()
        share = x0.shape[0] / batch.x0.shape[0]
        info = {"loss_base": error.mean().detach(),
                "loss": (loss / share if self.tcfg.loss_average == "points" else loss).detach()}
        return loss if self.tcfg.loss_average == "points" else loss * share, info
