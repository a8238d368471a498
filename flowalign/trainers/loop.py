"""Running a trainer: steps until the budget is spent, evaluations, logs, checkpoints, Ctrl-C and SIGTERM."""

from __future__ import annotations

import signal
import threading
from typing import Any

import torch
from tqdm.auto import tqdm

from flowalign import checkpoint as ckpt
from flowalign import signals
from flowalign.finite import check_training_finite, weight_labels
from flowalign.signals import Terminated


def run(trainer: Any) -> dict[str, Any]:
    """Resume if asked, then train until ``trainer.max_steps`` or ``max_minutes``; save, then evaluate.

    The final checkpoint comes before the final evaluation, so a kill during it loses no training. Ctrl-C
    (SIGINT) and SIGTERM (what schedulers send) finish the step in flight and save a checkpoint, then raise
    KeyboardInterrupt / :class:`flowalign.signals.Terminated` (a second signal stops at once): a
    checkpoint never holds half an update.
    """
    t = trainer
    t.maybe_resume()
    bar = tqdm(total=t.tcfg.max_steps, initial=t.step, desc="training", unit="step",
               disable=not (t.acc.is_main_process and t.cfg.run.progress))
    stop: dict[str, int | None] = {"signal": None}

    def request_stop(signum, frame):
        if stop["signal"] is not None:
            raise KeyboardInterrupt if signum == signal.SIGINT else Terminated("SIGTERM received twice; stopped "
                                                                               "without saving")
        stop["signal"] = signum
        if signum == signal.SIGTERM:
            signals.request_stop()  # a step or evaluation awaiting a hung reward gives up (flowalign.signals)
        if signum == signal.SIGINT:
            print("\ninterrupt: finishing this step, then saving a checkpoint (Ctrl-C again to stop now)")

    main_thread = threading.current_thread() is threading.main_thread()
    previous = {s: signal.signal(s, request_stop) for s in (signal.SIGINT, signal.SIGTERM)} if main_thread else {}
    saved_at = None  # the step of the checkpoint saved last by this loop
    try:
        if t.step == 0 and t.cfg.eval.at_start:
            t.evaluate()
        while t.step < t.tcfg.max_steps and not t.out_of_time():
            if agreed_signal(t, stop["signal"]) is not None:
                break
            if one_step(t, bar):
                saved_at = t.step
        if saved_at != t.step:
            t.save_checkpoint()
        agreed = agreed_signal(t, stop["signal"])  # also one that came during the last step
        if agreed is not None:
            _stopped(t, agreed)
    finally:
        bar.close()
        for s, handler in previous.items():
            signal.signal(s, handler)
    final = t.evaluate()
    t.logger.close()
    return final


def agreed_signal(t: Any, local: int | None) -> int | None:
    """The signal any rank has received, the same on every rank: a scheduler's SIGTERM reaches the ranks at
    slightly different times, and saving a checkpoint is a collective, so all ranks stop after one step."""
    if t.parallel.world == 1:
        return local
    flag = torch.tensor([local or 0], device=t.acc.device)
    return int(t.acc.reduce(flag, reduction="max")) or None


def _stopped(t: Any, signum: int) -> None:
    """Raise what the signal asked for, the checkpoint of this step saved."""
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    where = t.run_dir / "checkpoints" / ckpt.step_dir_name(t.step)
    raise Terminated(f"SIGTERM received; saved {where} at step {t.step} (rerun the same command to resume)")


def one_step(t: Any, bar: Any) -> bool:
    """A training step with its bookkeeping: LR, log line, evaluation and checkpoint when due; True when
    it saved a checkpoint."""
    t.optimisation.begin_step(t.budget_fraction())  # the schedule sets this step's LR in the optimiser
    logs = t.train_step()
    check_training_finite(t.step + 1, logs, weight_labels(t.trainable_state()), t.run_dir)
    logs["train/lr"] = t.optimisation.schedule.lr
    t.train_seconds += logs["time/step_cpu" if t.tcfg.budget_clock == "cpu" else "time/step"]  # the budget's clock
    t.step += 1
    logs["time/train_minutes"] = t.train_seconds / 60
    if t.step % t.cfg.run.log_every == 0:
        t.logger.log(t.step, logs)
    bar.set_postfix(reward=f"{logs.get('reward/total', float('nan')):.3f}", step_s=f"{logs['time/step']:.1f}")
    bar.update(1)
    last = t.step >= t.tcfg.max_steps or t.out_of_time()  # the final evaluation follows
    if t.cfg.eval.every and t.step % t.cfg.eval.every == 0 and not last:
        t.evaluate()
    if t.step % t.cfg.run.checkpoint_every == 0:
        t.save_checkpoint()
        return True
    return False


def evaluate(t: Any) -> dict[str, Any]:
    """Held-out evaluation (EMA weights when enabled) into ``evals/step-XXXXXX/`` and the gallery."""
    if t.evaluator is None:
        return {}
    metrics: dict[str, Any] = {}
    if t.parallel.takes_part():  # fsdp: every rank joins every forward
        with t.parallel.rank_folder(t.run_dir) as folder:  # other ranks write to a scratch folder
            out_dir = folder / "evals" / ckpt.step_dir_name(t.step)
            if t.ema is not None and t.step > 0:
                with t.ema.swapped_in():
                    metrics = t.evaluator(t.policy, out_dir)
            else:
                metrics = t.evaluator(t.policy, out_dir)
    if t.acc.is_main_process:
        scalars = {f"eval/{k}": v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        t.logger.log(t.step, scalars)
    t.acc.wait_for_everyone()
    return metrics
