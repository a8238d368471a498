"""DanceGRPO's loop around Flow-GRPO's loss, shared by DanceGRPO and Pref-GRPO (whose scripts are DanceGRPO's):
the best/worst subset of each group, ``⌊timestep_fraction·(T−1)⌋`` trained steps drawn per sample (or per
rollout batch) and epoch (:mod:`flowalign.trainers.parts.drawn_steps`), and their σ grid and integer timesteps
(:mod:`flowalign.trainers.parts.dance_schedule`)."""

from __future__ import annotations

from typing import Callable

import torch

from flowalign.errors import UserError
from flowalign.sampling import Rollout
from flowalign.trainers.parts.best_worst import best_and_worst, check_best_of
from flowalign.trainers.parts.dance_schedule import DanceSchedule
from flowalign.trainers.parts.drawn_steps import check_drawn_steps, drawn_reference_steps, drawn_steps, per_sample_batch
from flowalign.trainers.parts.global_plan import ChunkRef
from flowalign.trainers.rollouts import StepBatch


class DanceLoop(DanceSchedule):
    """Trainer hooks of the DanceGRPO loop; mixed in before ``FlowGRPOTrainer``, whose config then carries
    :class:`~flowalign.trainers.parts.drawn_steps.DrawnStepOptions`,
    :class:`~flowalign.trainers.parts.best_worst.BestWorstOptions` and
    :class:`~flowalign.trainers.parts.dance_schedule.DanceScheduleOptions` (their grid and timesteps)."""

    @classmethod
    def check_config(cls, cfg, tcfg) -> None:
        super().check_config(cfg, tcfg)  # type: ignore[misc]
        check_drawn_steps(tcfg)
        check_best_of(tcfg)
        if tcfg.best_of and tcfg.zero_advantage == "counted":
            raise UserError(f"trainer.best_of={tcfg.best_of} leaves samples out by zeroing their advantages, which "
                            "trainer.zero_advantage=counted would count: set trainer.zero_advantage: skipped with "
                            "best_of")

    @classmethod
    def training_batch(cls, tcfg) -> int:
        """With ``step_draw: per_sample`` a training forward holds one sample (each trains at its own drawn steps,
        as :meth:`collect` splits the batch); otherwise the batch."""
        return 1 if tcfg.step_draw == "per_sample" else super().training_batch(tcfg)  # type: ignore[misc]

    @classmethod
    def reference_steps(cls, tcfg) -> int:
        """``⌊timestep_fraction·(T−1)⌋`` drawn steps an epoch (:func:`drawn_reference_steps`)."""
        return drawn_reference_steps(tcfg)

    def collect(self, step: int) -> StepBatch:
        """The loop's batch; with ``best_of`` the other samples' advantages are zeroed (not trained); with
        ``step_draw: per_sample`` split into one-sample chunks (:func:`per_sample_batch`)."""
        batch = super().collect(step)  # type: ignore[misc]
        batch = best_and_worst(batch, self.tcfg.best_of) if self.tcfg.best_of else batch
        return per_sample_batch(batch) if self.tcfg.step_draw == "per_sample" else batch

    def prepare(self, batch: StepBatch, scored: Callable[[], bool]) -> dict[tuple[int, int], torch.Tensor]:
        """Flow-GRPO's KL reference means, computed on the chunks the plan trains: with ``step_draw: per_sample``
        the one-sample chunks :meth:`collect` makes, so a mean reads the same whether this computes it while the
        rewards are scored or the plan computes it after (bit for bit: the run does not depend on the timing)."""
        split = per_sample_batch(batch) if self.tcfg.step_draw == "per_sample" else batch  # type: ignore[attr-defined]
        return super().prepare(split, scored)  # type: ignore[misc]

    def counts_zero_advantage(self) -> bool:
        """``zero_advantage: counted``: a batch with no non-zero advantage counts in its optimiser step's size."""
        return self.tcfg.zero_advantage == "counted"

    def trained_steps(self, chunk: Rollout) -> list[int]:
        """Every stochastic step is a candidate (the random draw is in :meth:`chosen_steps`)."""
        return chunk.trained_steps()

    def chosen_steps(self, chunk: ChunkRef, epoch: int) -> list[int]:
        """:func:`~flowalign.trainers.parts.drawn_steps.drawn_steps` of the chunk, drawn as Flow-GRPO's
        ``steps_per_chunk`` draws them (keyed by the chunk's identity and the epoch, so the draw does not
        depend on the rank layout)."""
        return drawn_steps(chunk.steps, self.tcfg.num_steps, self.tcfg.timestep_fraction,
                           self.keyed_generator(*chunk.key, epoch, 17))
