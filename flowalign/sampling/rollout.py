"""The one sampling loop every trainer uses: ``rollout(policy, prompts, ...) -> Rollout``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from flowalign.errors import UserError
from flowalign.protocols import Conditioning, FlowPolicy
from flowalign.sampling.compressed_tail import CompressedTail
from flowalign.sampling.inputs import encode_prompts
from flowalign.sampling.ode_solvers import OdeSolver
from flowalign.sampling.sa_solver import SASolver
from flowalign.sampling.steps import SAMPLER_KINDS, StepFn, StepOutput, sde_step
from flowalign.sampling.timesteps import TimestepMap, model_timestep, truncated
from flowalign.sampling.windows import sde_step_mask

#: noise level used when a caller passes none: a (Flow-GRPO; floored: UMM-Reflection's revisions), η (CPS), η (DanceGRPO)
DEFAULT_NOISE_LEVEL = {"ode": 0.0, "flow_grpo": 0.7, "cps": 0.8, "dance": 0.3, "flow_grpo_floored": 1.0}
NOISE_LEVEL_RANGE = {"flow_grpo": (0.0, 2.0), "cps": (0.0, 1.0), "dance": (0.0, 1.0), "ode": (0.0, 0.0),
                     "flow_grpo_floored": (0.0, 2.0)}


@dataclass
class Rollout:
    """A batch of sampled trajectories.

    ``latents`` ``(B, T+1, ...)`` (``latents[:, 0]`` is the noise, ``latents[:, T]`` the sample), float32;
    ``sigmas`` ``(T+1,)``; ``log_probs`` ``(B, T)`` log-probabilities stored at sampling time (NaN on
    ODE steps); ``sde_mask`` ``(T,)`` bool; ``samples`` decoded ``(B,3,H,W)`` or ``(B,F,3,H,W)`` in
    [0,1] (``None`` when not decoded); ``cond`` the conditioning used; ``guidance_scale`` and ``sampler``
    record how they were drawn so trainers re-evaluate the same distribution; ``velocities``
    ``(B, T, ...)`` the policy's velocity at every step when the rollout kept them (else ``None``);
    ``unconditional_velocities`` ``(B, T, ...)`` CFG's unconditional branch ``v_u`` at every step when
    the rollout kept it (else ``None``).
    """

    prompts: list[str]
    metadata: list[dict[str, Any]]
    latents: torch.Tensor
    sigmas: torch.Tensor
    log_probs: torch.Tensor
    sde_mask: torch.Tensor
    samples: torch.Tensor | None
    cond: Conditioning
    sampler: str = "ode"
    noise_level: float = 0.0
    guidance_scale: float = 1.0
    velocities: torch.Tensor | None = None
    unconditional_velocities: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.latents.shape[0]

    @property
    def num_steps(self) -> int:
        return self.sigmas.shape[0] - 1

    @property
    def final_latents(self) -> torch.Tensor:
        return self.latents[:, -1]

    def trained_steps(self) -> list[int]:
        """Indices of the stochastic (trainable) steps."""
        return self.sde_mask.nonzero().flatten().tolist()

    def step(self, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(x_k, x_{k+1}, stored log_prob_k)`` for every sample: ``(B,...)``, ``(B,...)``, ``(B,)``."""
        return self.latents[:, k], self.latents[:, k + 1], self.log_probs[:, k]

    def select(self, index: Sequence[int] | torch.Tensor | slice) -> "Rollout":
        """The rollout restricted to some samples (in the given order). A ``slice`` keeps its tensors as views of
        this rollout's (no copy); indices copy them."""
        if isinstance(index, slice):
            rows, take = list(range(len(self)))[index], index
        else:
            take = torch.as_tensor(index, dtype=torch.long).flatten()
            rows = take.tolist()
        return Rollout(
            prompts=[self.prompts[i] for i in rows],
            metadata=[self.metadata[i] for i in rows],
            latents=self.latents[take],
            sigmas=self.sigmas,
            log_probs=self.log_probs[take],
            sde_mask=self.sde_mask,
            samples=None if self.samples is None else self.samples[take],
            cond=self.cond[rows],
            sampler=self.sampler,
            noise_level=self.noise_level,
            guidance_scale=self.guidance_scale,
            velocities=None if self.velocities is None else self.velocities[take],
            unconditional_velocities=None if self.unconditional_velocities is None else self.unconditional_velocities[take],
        )

    __getitem__ = select

    def single(self, j: int) -> "Rollout":
        """Sample ``j`` alone as a one-sample rollout whose tensors are views of this one's (no copy: splitting a
        batch into its samples costs no memory while both are held)."""
        return self.select(slice(j, j + 1))

    @staticmethod
    def cat(parts: list["Rollout"]) -> "Rollout":
        """The samples of ``parts`` in order, as one rollout (e.g. a micro-batch re-formed from several rollout
        batches). They must have been drawn alike: the same sigma grid, SDE steps, sampler and guidance (what a
        trainer re-evaluates them under). ``samples`` and stored velocities are kept only where every part has
        them."""
        first = parts[0]
        for p in parts[1:]:
            if not (torch.equal(p.sigmas, first.sigmas) and torch.equal(p.sde_mask, first.sde_mask)
                    and (p.sampler, p.noise_level, p.guidance_scale)
                    == (first.sampler, first.noise_level, first.guidance_scale)):
                raise ValueError("Rollout.cat: the parts were drawn differently (sigmas, SDE steps, sampler or guidance)")

        def joined(name: str) -> torch.Tensor | None:
            values = [getattr(p, name) for p in parts]
            return None if any(v is None for v in values) else torch.cat(values)

        return Rollout(
            prompts=[s for p in parts for s in p.prompts],
            metadata=[m for p in parts for m in p.metadata],
            latents=torch.cat([p.latents for p in parts]),
            sigmas=first.sigmas,
            log_probs=torch.cat([p.log_probs for p in parts]),
            sde_mask=first.sde_mask,
            samples=joined("samples"),
            cond=Conditioning.cat([p.cond for p in parts]),
            sampler=first.sampler,
            noise_level=first.noise_level,
            guidance_scale=first.guidance_scale,
            velocities=joined("velocities"),
            unconditional_velocities=joined("unconditional_velocities"),
        )


def check_prompts(prompts: Any) -> list[str]:
    if isinstance(prompts, str) or not isinstance(prompts, (list, tuple)):
        raise UserError(f"prompts must be a list of strings, got {type(prompts).__name__}; wrap a single prompt as [prompt]")
    bad = [p for p in prompts if not isinstance(p, str)]
    if bad:
        raise UserError(f"prompts must be a list of strings; found a {type(bad[0]).__name__}: {bad[0]!r}")
    if not prompts:
        raise UserError("prompts is empty; give at least one prompt")
    return list(prompts)


def check_sampler(sampler: str, noise_level: float | None) -> float:
    """Validate a sampler kind and its noise level; returns the noise level to use."""
    if sampler not in SAMPLER_KINDS:
        raise UserError(f"unknown sampler {sampler!r}; choose one of {', '.join(SAMPLER_KINDS)}")
    level = DEFAULT_NOISE_LEVEL[sampler] if noise_level is None else float(noise_level)
    lo, hi = NOISE_LEVEL_RANGE[sampler]
    if sampler == "ode":
        return 0.0
    if not lo <= level <= hi:
        raise UserError(f"noise level {level} is out of range for sampler {sampler!r}: use a value in [{lo}, {hi}]")
    return level


@torch.no_grad()
def rollout(
    policy: FlowPolicy,
    prompts: Sequence[str],
    *,
    num_steps: int,
    sampler: str | StepFn | OdeSolver | SASolver = "flow_grpo",
    noise_level: float | None = None,
    guidance_scale: float | None = None,
    sde_window: tuple[int, int] | torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    metadata: Sequence[dict[str, Any]] | None = None,
    initial_noise: torch.Tensor | None = None,
    decode: bool = True,
    cps_log_prob: str = "code",
    guide: Callable[..., torch.Tensor] | None = None,
    keep_velocities: bool = False,
    generators: Sequence[torch.Generator] | None = None,
    sde_last_step: bool = False,
    keep_unconditional: bool = False,
    prefix: torch.Tensor | None = None,
    grid: Callable[[int], torch.Tensor] | None = None,
    timestep_form: TimestepMap | None = None,
    tail: CompressedTail | None = None,
) -> Rollout:
    """Sample ``len(prompts)`` trajectories of ``num_steps`` steps from the policy's own sigma grid, or from
    ``grid(num_steps)`` ``(num_steps + 1,)`` (an authors' grid, e.g. :class:`~flowalign.sampling.timesteps.ShiftedGrid`).

    SDE steps (``sampler``: a kind of :func:`sde_step` or a custom step function, on the steps of
    ``sde_window``; the step to σ = 0 only with ``sde_last_step``) store their log-probabilities; all other
    steps are Euler ODE steps. An :class:`~flowalign.sampling.ode_solvers.OdeSolver` ``sampler`` integrates
    every step with its deterministic solver on its grid, the transformer reading its timestep form (the
    rollout's ``sigmas`` are that grid); an :class:`~flowalign.sampling.sa_solver.SASolver` likewise, its
    steps with τ > 0 stochastic (they store log-probabilities). ``guidance_scale`` defaults to the checkpoint's own default. Pass
    ``initial_noise`` ``(B, ...)`` to share noise (e.g. DanceGRPO groups) or to branch from an ODE
    prefix.

    ``guide`` (e.g. :class:`flowalign.sampling.guidance.Guidance`, reward-guided sampling) maps each
    step's velocity ``guide(v, x, σ, cond) -> v_c`` before the step. ``keep_velocities`` stores the
    policy's velocities (before any guide) in ``velocities`` ``(B, T, ...)`` (trainers that distil toward
    them need no second forward pass). ``keep_unconditional`` (CFG with a policy that has
    ``velocity_and_unconditional``) also stores CFG's unconditional branch ``v_u`` of each step's batched
    pass in ``unconditional_velocities``: a trainer whose loss detaches that branch reuses it while its
    weights are still the sampling weights.

    ``timestep_form`` (e.g. :func:`~flowalign.sampling.timesteps.truncated`): what the transformer reads of its
    timestep at every step (:func:`~flowalign.sampling.timesteps.model_timestep`; None: the pipeline's, or the
    solver's form).

    ``generators`` (one per sample) draws each sample's initial noise and SDE noise from its own stream,
    so a sample does not depend on which others share its batch (or rank); ``generator`` draws the
    whole batch's noise from one stream.

    ``prefix`` ``(B, k + 1, ...)``: the states ``x_T … x_k`` of trajectories already integrated over their first
    ``k`` steps, all ODE steps (e.g. one ODE trajectory that several branches leave at step ``k``): the rollout
    starts at ``x_k`` with step ``k``; the prefix's states stand as its first latents, its steps' log-probs are
    NaN (ODE) and, with ``keep_unconditional``, their unconditional velocities NaN (not computed here).

    ``tail`` (MixGRPO-Flash, :class:`~flowalign.sampling.compressed_tail.CompressedTail`): after the last SDE step
    the rollout continues on a compressed grid with DPM-Solver++(2); its ``sigmas`` are that grid ``(L + 1,)``, its
    latents ``(B, L + 1, ...)``, every step through the window as without the tail.
    """
    prompts = check_prompts(prompts)
    if getattr(policy, "streaming", False):
        raise UserError(f"{policy.family} generates video chunk by chunk with a KV cache: sample it with "
                        "flowalign.sampling.streaming.stream_rollout and train it with a streaming trainer")
    solver = sampler if isinstance(sampler, (OdeSolver, SASolver)) else None
    custom_step = sampler if callable(sampler) else None
    if solver is not None:
        level = solver.noise_level
    else:
        level = 0.0 if custom_step else check_sampler(sampler, noise_level)
    if num_steps < 1:
        raise UserError(f"num_steps must be >= 1, got {num_steps}")
    guidance = float(policy.defaults.get("guidance_scale", 1.0) if guidance_scale is None else guidance_scale)
    meta = [dict(m) for m in metadata] if metadata is not None else [{} for _ in prompts]
    if len(meta) != len(prompts):
        raise UserError(f"metadata has {len(meta)} entries for {len(prompts)} prompts; give one dict per prompt")

    cond = encode_prompts(policy, prompts, meta)  # with metadata['image'] for image-conditioned policies
    if solver is not None and (grid is not None or timestep_form is not None):
        raise ValueError("rollout: a solver sets its own grid and timestep form; pass grid / timestep_form without one")
    sigmas = solver.sigmas(policy.sigmas, num_steps) if solver else (grid or policy.sigmas)(num_steps).float()
    if sigmas.shape != (num_steps + 1,):
        raise ValueError(f"rollout: the grid has shape {tuple(sigmas.shape)} for {num_steps} steps; give num_steps + 1 sigmas")
    start = 0 if prefix is None else prefix.shape[1] - 1
    x = _start(policy, len(prompts), initial_noise, generator, generators) if prefix is None else \
        _prefix_start(policy, prefix, len(prompts), num_steps, keep_velocities)
    # CPS has τ = 0 on the step to σ' = 0: that step stays an ODE step whatever ``sde_last_step`` says
    last = sde_last_step and sampler != "cps"
    if solver is not None:
        mask = solver.stochastic_steps(sigmas)
    else:
        mask = torch.zeros(num_steps, dtype=torch.bool) if sampler == "ode" else sde_step_mask(num_steps, sde_window, last)
    solver_step = solver.steps(sigmas) if solver else None
    tail_steps = None
    if tail is not None:
        if solver is not None or prefix is not None:
            raise ValueError("rollout: a compressed tail follows an SDE window from x_T; not with a solver or a prefix")
        sigmas, mask, tail_steps = tail.apply(sigmas, mask)

    def step_at(k: int) -> StepFn:
        if solver_step is not None:
            return solver_step
        if tail_steps is not None and k > tail_steps.last:
            return tail_steps
        if custom_step is not None and mask[k]:
            step = custom_step
        else:
            step = _kind_step(sampler if mask[k] else "ode", level, cps_log_prob)
        return tail_steps.through(step) if tail_steps is not None and k == tail_steps.last else step

    if mask[:start].any():
        raise UserError(f"prefix: its {start} steps are ODE steps, but the rollout's steps "
                        f"{mask[:start].nonzero().flatten().tolist()} are stochastic; start after them")
    keep_unconditional = keep_unconditional and guidance > 1 and hasattr(policy, "velocity_and_unconditional")
    form = truncated if solver is not None and solver.timestep == "truncated" else timestep_form
    latents, log_probs, velocities, unconditional = _integrate(
        policy, x, sigmas, cond, guidance, mask, step_at, generator=generator, generators=generators,
        guide=guide, keep_velocities=keep_velocities, keep_unconditional=keep_unconditional, timestep_form=form,
        first_step=start)
    if start:
        latents = [*prefix[:, :-1].float().to(policy.device).unbind(1), *latents]
        log_probs = torch.cat([torch.full((len(prompts), start), float("nan")), log_probs], dim=1)
        unconditional = [torch.full_like(unconditional[0], float("nan"))] * start + unconditional if unconditional \
            else unconditional
    x = latents[-1]
    samples = policy.decode(x) if decode else None
    return Rollout(
        prompts=prompts,
        metadata=meta,
        latents=torch.stack(latents, dim=1),
        sigmas=sigmas.cpu(),
        log_probs=log_probs,
        sde_mask=mask,
        samples=samples,
        cond=cond,
        sampler=solver.name if solver else getattr(sampler, "__name__", "custom") if custom_step else sampler,
        noise_level=level,
        guidance_scale=guidance,
        velocities=torch.stack(velocities, dim=1) if keep_velocities else None,
        unconditional_velocities=torch.stack(unconditional, dim=1) if keep_unconditional else None,
    )


@torch.no_grad()
def continue_ode(policy: FlowPolicy, x: torch.Tensor, sigmas: torch.Tensor, cond: Any, guidance: float) -> torch.Tensor:
    """Euler ODE steps from ``x`` ``(B, ...)`` at ``sigmas[0]`` along ``sigmas`` to ``sigmas[-1]``: the final
    latents ``(B, ...)`` (how a state branched off a trajectory mid-way is finished with the ODE sampler)."""
    mask = torch.zeros(len(sigmas) - 1, dtype=torch.bool)
    ode = _kind_step("ode", 0.0, "code")
    latents, *_ = _integrate(policy, x.to(policy.device), sigmas.float(), cond, guidance, mask, lambda k: ode,
                             generator=None, generators=None, guide=None, keep_velocities=False)
    return latents[-1]


def _integrate(
    policy: FlowPolicy,
    x: torch.Tensor,
    sigmas: torch.Tensor,
    cond: Any,
    guidance: float,
    mask: torch.Tensor,
    step_at: Callable[[int], StepFn],
    *,
    generator: torch.Generator | None,
    generators: Sequence[torch.Generator] | None,
    guide: Callable[..., torch.Tensor] | None,
    keep_velocities: bool,
    keep_unconditional: bool = False,
    timestep_form: TimestepMap | None = None,
    first_step: int = 0,
) -> tuple[list[torch.Tensor], torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """Run steps ``first_step … len(mask) − 1`` from ``x`` ``(B, ...)`` (the state at ``sigmas[first_step]``)
    along ``sigmas``, step ``k`` with ``step_at(k)``, the transformer reading ``timestep_form`` of its timestep
    (None: the pipeline's; :func:`model_timestep`).

    Returns the latents ``[x_first, ..., x_T]`` (each ``(B, ...)``), the log-probs ``(B, T − first_step)`` (NaN
    on ODE steps), with ``keep_velocities`` the policy's velocities before any guide and with
    ``keep_unconditional`` the unconditional velocities (else empty lists).
    """
    latents = [x]
    log_probs = []  # on the device until the last step: reading each step's would make the host wait for it
    velocities, unconditional = [], []
    for k in range(first_step, len(mask)):
        with model_timestep(policy, timestep_form, sigmas[k].item()):
            if keep_unconditional:
                v, v_u = policy.velocity_and_unconditional(x, sigmas[k].item(), cond, guidance)
                unconditional.append(v_u)
            else:
                v = policy.velocity(x, sigmas[k].item(), cond, guidance)
        if keep_velocities:
            velocities.append(v.float())
        if guide is not None:
            v = guide(v, x, sigmas[k].item(), cond)
        step = step_at(k)
        if generators is not None and mask[k]:
            out = _per_sample_noise_step(step, v, x, sigmas[k].item(), sigmas[k + 1].item(), generators)
        else:
            out = step(v, x, sigmas[k].item(), sigmas[k + 1].item(), generator, None)
        x = out.prev_sample
        latents.append(x)
        log_probs.append(out.log_prob)
    stored = torch.stack(log_probs, dim=1).float().cpu() if log_probs else torch.full((x.shape[0], 0), float("nan"))
    return latents, stored, velocities, unconditional


def _start(policy: FlowPolicy, n: int, initial_noise: torch.Tensor | None, generator: torch.Generator | None,
           generators: Sequence[torch.Generator] | None) -> torch.Tensor:
    """``x_T`` ``(n, ...)`` on the policy's device: as given, one draw per sample generator, or one batch draw."""
    if generators is not None and len(generators) != n:
        raise UserError(f"generators has {len(generators)} entries for {n} prompts; give one per prompt")
    if initial_noise is not None:
        x = initial_noise.float()
    elif generators is not None:
        x = torch.cat([policy.initial_noise(1, g) for g in generators])
    else:
        x = policy.initial_noise(n, generator)
    return x.to(policy.device)


def _prefix_start(policy: FlowPolicy, prefix: torch.Tensor, n: int, num_steps: int, keep_velocities: bool) -> torch.Tensor:
    """``x_k`` ``(n, ...)`` on the policy's device, the last state of ``prefix`` ``(n, k + 1, ...)``, checked."""
    if prefix.ndim < 3 or prefix.shape[0] != n or not 1 <= prefix.shape[1] <= num_steps:
        raise UserError(f"prefix: shape {tuple(prefix.shape)}; give (samples={n}, k + 1, ...) states x_T … x_k "
                        f"with k < num_steps={num_steps}")
    if keep_velocities:
        raise UserError("prefix: keep_velocities needs every step's velocity, which a prefix's steps did not keep "
                        "here; roll out from x_T instead")
    return prefix[:, -1].float().to(policy.device)


def _kind_step(kind: str, level: float, cps_log_prob: str) -> StepFn:
    """:func:`sde_step` of one sampler kind in the :data:`StepFn` form."""

    def step(v, x, sigma, sigma_next, generator, prev_sample):
        return sde_step(kind, v, x, sigma, sigma_next, noise_level=level, generator=generator, prev_sample=prev_sample,
                        cps_log_prob=cps_log_prob)

    return step


def _per_sample_noise_step(step: StepFn, v: torch.Tensor, x: torch.Tensor, sigma: float, sigma_next: float,
                           generators: Sequence[torch.Generator]) -> StepOutput:
    """One stochastic step whose noise ``ξ_i`` comes from sample i's own generator: the step's Gaussian
    ``(μ, τ)`` first (evaluated at a placeholder), then ``x' = μ + τ·ξ`` and its log-probability,
    exactly as the step computes them when it draws the noise itself."""
    gaussian = step(v, x, sigma, sigma_next, None, x)
    noise = torch.stack([torch.randn(x.shape[1:], generator=g, dtype=torch.float32) for g in generators])
    x_next = gaussian.mean + gaussian.std * noise.to(gaussian.mean.device, non_blocking=True)
    return step(v, x, sigma, sigma_next, None, x_next)
