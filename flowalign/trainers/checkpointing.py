"""The loop's checkpoints: weights, optimiser, EMA, RNG states, and the trainer's own state.

A trainer's :meth:`state_dict` is stored with the weights: its tensors in ``trainable.safetensors``
under the ``behaviour.`` prefix (so tools that read weights skip them), everything else (ints, lists,
strings) in ``trainer_state.json`` under ``"hooks"``. Resume restores both, then hands the trainer its
state back through :meth:`load_state_dict`.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

from flowalign import checkpoint as ckpt
from flowalign import checkpoint_manifest
from flowalign.errors import UserError
from flowalign.finite import check_training_finite, weight_labels


def split_state(state: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A trainer state → (tensors under the checkpoint prefix, the JSON rest)."""
    tensors = {f"{ckpt.TRAINER_STATE_PREFIX}{k}": v for k, v in state.items() if isinstance(v, torch.Tensor)}
    rest = {k: v for k, v in state.items() if not isinstance(v, torch.Tensor)}
    return tensors, rest


def save(trainer: Any) -> Path:
    """Write ``checkpoints/step-N/`` atomically (every rank takes part; the main process writes)."""
    acc, step = trainer.acc, trainer.step
    check_training_finite(step, {}, weight_labels(trainer.trainable_state()), trainer.run_dir)  # never NaN
    final = trainer.run_dir / "checkpoints" / ckpt.step_dir_name(step)
    tmp = trainer.run_dir / "checkpoints" / f".tmp-{ckpt.step_dir_name(step)}"
    if acc.is_main_process:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    acc.wait_for_everyone()
    checksums = trainer.rank_checksums()
    ckpt.save_rank_rng(tmp, trainer.parallel.rank)  # each process's own
    parallel = trainer.parallel
    # fsdp: every rank takes part in gathering full tensors and writes its optimiser shard
    trainable = parallel.gather(trainer.trainable_state())
    ema_state = parallel.gather(trainer.ema.state_dict()) if trainer.ema else None
    sharded_optimizer = parallel.save_optimizer(tmp, trainer.policy.trainable, trainer.optimizer)
    if trainer.cfg.model.finetune == "lora" and parallel.takes_part():  # fsdp: gathering it is a collective
        with parallel.rank_folder(tmp) as folder:
            trainer.policy.save_adapter(folder)
    if acc.is_main_process:
        _, hooks = split_state(trainer.state_dict())
        ckpt.write_checkpoint_files(
            tmp, trainable=trainable, optimizer=None if sharded_optimizer else trainer.optimizer,
            ema_state=ema_state,
            trainer_state={"step": step, "world_size": trainer.parallel.world, "trainer": trainer.tcfg.name,
                           "rank_checksums": checksums, "train_seconds": trainer.train_seconds,
                           "train_cpu_seconds": trainer.train_cpu_seconds, "hooks": hooks},
        )
    acc.wait_for_everyone()
    if acc.is_main_process:
        ckpt.finalise(tmp, final)
        ckpt.prune(trainer.run_dir, trainer.cfg.run.keep_checkpoints)
    acc.wait_for_everyone()
    return final


def resume_folder(trainer: Any) -> Path | None:
    """The checkpoint ``run.resume`` names (``auto``: the newest one that verifies against its
    manifest), or None."""
    resume = trainer.cfg.run.resume
    if resume == "never":
        return None
    return checkpoint_manifest.resume_folder(trainer.run_dir, resume, main=trainer.acc.is_main_process)


def resume(trainer: Any) -> None:
    """Restore weights, optimiser, EMA, RNG, step and the trainer's state from ``run.resume``."""
    if trainer.cfg.run.resume == "never":
        return
    folder = resume_folder(trainer)
    if folder is None:
        trainer.logger.truncate_after(-1)  # a run killed before its first checkpoint starts over
        return
    state = ckpt.load_checkpoint(folder)
    # the trainer's own tensors a checkpoint lacks (saved before the trainer kept them) are its load_state_dict's
    live = {k: v for k, v in trainer.trainable_state().items() if k in state["trainable"] or not k.startswith(
        ckpt.TRAINER_STATE_PREFIX)}
    missing = set(live) - set(state["trainable"])
    if missing:
        raise UserError(f"checkpoint {folder} does not match this model ({len(missing)} trainable tensors missing)")
    parallel = trainer.parallel
    saved = parallel.place_like({k: state["trainable"][k] for k in live}, live)  # fsdp: this rank's shards
    with torch.no_grad():
        for name, p in live.items():
            p.copy_(saved[name])
    parallel.load_optimizer(folder, trainer.policy.trainable, trainer.optimizer, state["optimizer"])
    if trainer.ema is not None and state["ema"] is not None:
        trainer.ema.load_state_dict(parallel.place_like(state["ema"], trainer.ema.state_dict()))
    ckpt.load_rank_rng(folder, trainer.parallel.rank)
    trainer.step = int(state["trainer_state"]["step"])
    trainer.train_seconds = float(state["trainer_state"].get("train_seconds", 0.0))
    trainer.train_cpu_seconds = float(state["trainer_state"].get("train_cpu_seconds", 0.0))
    prefix = ckpt.TRAINER_STATE_PREFIX
    own = {k[len(prefix):]: v for k, v in state["trainable"].items() if k.startswith(prefix)}
    try:
        trainer.load_state_dict({**state["trainer_state"].get("hooks", {}), **own})
    except KeyError as missing:  # state this trainer keeps that the checkpoint lacks: one line, nothing lost
        raise UserError(f"checkpoint {folder} holds no {missing.args[0]!r} of {trainer.tcfg.name}'s state (saved "
                        "by an earlier flowalign, or with other trainer settings); resume it with the flowalign and "
                        "settings it was saved with, or choose another run.output_dir") from None
    trainer.logger.truncate_after(trainer.step)
    if trainer.acc.is_main_process:
        print(f"resumed from {folder} at step {trainer.step}")
