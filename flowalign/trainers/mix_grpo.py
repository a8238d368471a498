"""MixGRPO (arXiv 2507.21802): Flow-GRPO on a sliding window of SDE steps (``docs/methods/mix_grpo.md``).

Every rollout runs the ODE except on a window of ``window_size`` consecutive steps, where it runs the
Flow-GRPO SDE; only those steps are trained, with Flow-GRPO's loss. The window is the same for every
prompt and moves ``window_stride`` steps later every ``shift_interval`` training steps, rolling back to the
first step at the end (:func:`flowalign.sampling.windows.sliding_window`): a function of the training step
alone, so every rank and a resumed run place it alike. Its scripts are built on DanceGRPO's: their σ grid and
integer timesteps are :mod:`flowalign.trainers.parts.dance_schedule`'s. MixGRPO-Flash (``post_window_solver:
dpm2``) finishes each rollout after the window on a compressed grid with DPM-Solver++(2)
(:class:`flowalign.sampling.CompressedTail`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from flowalign.config import changed
from flowalign.errors import UserError
from flowalign.limits import MAX_COEFFICIENT, MAX_SAMPLING_STEPS, MAX_TRAIN_STEPS
from flowalign.sampling import CompressedTail, Rollout, sliding_window
from flowalign.trainers.base import Sampling, StepBatch
from flowalign.trainers.flow_grpo import (CPSOptions, FlowGRPOBase, FlowGRPOTrainer, SDEOptions, StepSubsetOptions,
                                           steps_over_epochs)
from flowalign.trainers.options import ReferenceOptions
from flowalign.trainers.parts.advantage_std import AdvantageStdOptions, advantage_std_options
from flowalign.trainers.parts.dance_schedule import DanceSchedule, DanceScheduleOptions


class MixGRPOConfig(FlowGRPOBase, ReferenceOptions, SDEOptions, CPSOptions, StepSubsetOptions, AdvantageStdOptions,
                    DanceScheduleOptions):
    name: Literal["mix_grpo"] = "mix_grpo"  # type: ignore[assignment]
    #: what runs saved before these options existed computed (see TrainerConfig.before)
    before = {"advantage_std": "population", "reward_weights": "as_written", "sigma_grid": "model",
              "model_timestep": "continuous"}
    #: each reward's group advantage, weight-summed (the authors' --use_group with advantage_aggr; with one
    #: reward, ``group``)
    advantage: str = Field("per_reward", pattern="^(group|global_std|per_reward|gdpo|win_rate)$")
    #: "normalised": the rewards' weights divided by their sum before the advantages are formed (the authors'
    #: script normalises its reward weights at start); "as_written": the weights as the config gives them
    reward_weights: Literal["normalised", "as_written"] = "normalised"
    clip_range: float = Field(1e-4, gt=0, le=MAX_COEFFICIENT)
    beta: float = Field(0.0, ge=0, le=MAX_COEFFICIENT)
    shared_initial_noise: bool = True
    #: SDE (and trained) steps per rollout (the authors' group_size 4)
    window_size: int = Field(4, ge=1, le=MAX_SAMPLING_STEPS)
    #: training steps before the window moves (the authors' iters_per_group 25)
    shift_interval: int = Field(25, ge=1, le=MAX_TRAIN_STEPS)
    #: steps the window moves each time (the authors' prog_overlap_step 1; 0 keeps it at step 0, MixGRPO-Flash*)
    window_stride: int = Field(1, ge=0, le=MAX_SAMPLING_STEPS)
    #: the ODE after the window: "euler" on the rollout grid (MixGRPO); "dpm2", MixGRPO-Flash: the rest of the
    #: shifted grid compressed to post_window_compress of its points and integrated with DPM-Solver++(2) (the
    #: authors' dpm_algorithm_type dpmsolver++, dpm_apply_strategy post, order 2, midpoint)
    post_window_solver: Literal["euler", "dpm2"] = "euler"
    #: the share of the grid's points after the window kept with post_window_solver dpm2 (the authors'
    #: dpm_post_compress_ratio: 0.4 MixGRPO-Flash, 0.2 Flash*)
    post_window_compress: float = Field(0.4, gt=0, le=1)

    @model_validator(mode="after")
    def _the_tail_reads_the_shifted_grid(self):
        if self.post_window_solver == "dpm2" and self.sigma_grid != "shifted":
            raise ValueError("trainer.post_window_solver=dpm2 compresses the authors' shifted grid: set "
                             "trainer.sigma_grid=shifted (this config has model) or post_window_solver=euler")
        if changed(self, "post_window_compress") and self.post_window_solver != "dpm2":
            raise ValueError("trainer.post_window_compress is read only with trainer.post_window_solver=dpm2: drop "
                             "it or set post_window_solver=dpm2")
        return self


class MixGRPOTrainer(DanceSchedule, FlowGRPOTrainer):
    Config = MixGRPOConfig
    tcfg: MixGRPOConfig

    @classmethod
    def check_config(cls, cfg, tcfg) -> None:
        super().check_config(cfg, tcfg)
        if tcfg.num_steps < 3:
            raise UserError(f"trainer.num_steps={tcfg.num_steps}: mix_grpo's window needs at least 3 steps")

    @classmethod
    def reference_steps(cls, tcfg: MixGRPOConfig) -> int:
        """The window's ``window_size`` steps (every one trained), at most ``steps_per_chunk`` an epoch."""
        steps = min(tcfg.num_steps, tcfg.window_size)
        per_epoch = tcfg.steps_per_chunk if 0 < tcfg.steps_per_chunk < steps else steps
        return steps_over_epochs(steps, per_epoch, tcfg.inner_epochs)

    @classmethod
    def rollouts_per_step(cls, tcfg: MixGRPOConfig) -> tuple[int, int, int]:
        """With ``post_window_solver: dpm2`` a rollout holds the steps of its compressed grid, not ``num_steps``:
        the longest over the windows the schedule places (Flash*'s window at step 0 keeps them few)."""
        prompts, group, steps = super().rollouts_per_step(tcfg)
        if tcfg.post_window_solver != "dpm2":
            return prompts, group, steps
        tail = CompressedTail(tcfg.sigma_shift, tcfg.post_window_compress)
        windows = {sliding_window(k * tcfg.shift_interval, steps, tcfg.window_size, tcfg.shift_interval,
                                  tcfg.window_stride) for k in range(steps)}
        return prompts, group, max(len(tail.sigmas(steps, start + width - 1)) - 1 for start, width in windows)

    def advantage_options(self) -> dict[str, Any]:
        """The authors' unbiased std + 1e-8 (:func:`advantage_std_options`) and reward weights summing to 1."""
        return {**advantage_std_options(self.tcfg), "normalise_weights": self.tcfg.reward_weights == "normalised"}

    def window(self, step: int) -> tuple[int, int]:
        """``(start, width)`` of the SDE window at training step ``step``."""
        t = self.tcfg
        return sliding_window(step, t.num_steps, t.window_size, t.shift_interval, t.window_stride)

    def sampling(self, group: int) -> Sampling:
        """ODE everywhere but the window of the current step (the same for every group); with
        ``post_window_solver: dpm2`` the ODE after it on the compressed grid."""
        t = self.tcfg
        tail = CompressedTail(t.sigma_shift, t.post_window_compress) if t.post_window_solver == "dpm2" else None
        return Sampling(self.sampler, self.noise_level, self.window(self.step), False,
                        cps_log_prob=t.cps_log_prob, keep_unconditional=self.reuses_unconditional,
                        grid=self.rollout_grid, timestep_form=self.timestep_form, tail=tail)

    def collect(self, step: int) -> StepBatch:
        batch = super().collect(step)
        batch.logs["window_start"] = float(self.window(step)[0])
        return batch

    def trained_steps(self, chunk: Rollout) -> list[int]:
        """Every step of the window (``timestep_fraction`` does not apply)."""
        return chunk.trained_steps()
