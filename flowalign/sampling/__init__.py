"""Step math and the rollout loop (``docs/methods/samplers.md``).

Public entry points: :func:`sde_step` (one step of ``"ode" | "flow_grpo" | "flow_grpo_floored" | "cps" |
"dance"``), :func:`rollout` (the sampling loop returning a :class:`Rollout`; an :class:`OdeSolver` as its
``sampler`` integrates deterministically with Euler or multistep DPM-Solver++(2), an :class:`SASolver` with
the stochastic Adams predictor-corrector, a :class:`CompressedTail` finishes after the SDE window on a shorter
grid); streaming video policies are sampled chunk by
chunk by :func:`stream_rollout` (a :class:`StreamRollout`).
"""

from flowalign.sampling.branching import branch_candidates, draw_branch_step, noise_aware_weights
from flowalign.sampling.compressed_tail import CompressedTail
from flowalign.sampling.guidance import Guidance, GuidedPolicy, guide_velocity, load_latent_reward, reward_gradient
from flowalign.sampling.ode_solvers import OdeSolver
from flowalign.sampling.sa_solver import SASolver
from flowalign.sampling.rollout import Rollout, check_sampler, continue_ode, rollout
from flowalign.sampling.steps import (
    SAMPLER_KINDS,
    StepOutput,
    cps_step,
    euler_step,
    flow_grpo_diffusion,
    floored_flow_grpo_diffusion,
    floored_flow_sde_step,
    flow_sde_step,
    gaussian_log_prob,
    sde_step,
)
from flowalign.sampling.streaming import StreamPrefix, StreamRollout, stream_rollout
from flowalign.sampling.windows import random_window_start, sde_step_mask, sliding_window

__all__ = [
    "SAMPLER_KINDS", "CompressedTail", "Guidance", "GuidedPolicy", "OdeSolver", "Rollout", "SASolver", "StepOutput", "branch_candidates", "check_sampler",
    "continue_ode", "cps_step", "draw_branch_step", "euler_step", "floored_flow_grpo_diffusion", "floored_flow_sde_step", "flow_grpo_diffusion", "flow_sde_step", "gaussian_log_prob",
    "guide_velocity", "load_latent_reward", "noise_aware_weights", "random_window_start", "reward_gradient",
    "rollout", "sde_step", "sde_step_mask", "sliding_window", "StreamPrefix", "StreamRollout", "stream_rollout",
]
