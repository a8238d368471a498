"""One resumable training stage of a tiny-world pretraining run (VAE, decoder or transformer).

A stage lives in ``OUT/<name>/``: ``checkpoints/step-XXXXXX/`` written by :mod:`flowalign.checkpoint`
(weights, optimiser, EMA and RNG states as safetensors, ``COMPLETE`` last), ``metrics.jsonl``
(:class:`flowalign.logger.RunLogger`) and ``DONE`` once its budget (:class:`flowalign.budget.Budget`) is
spent. Each step draws its randomness from generators seeded by (seed, stage, step), so a stage resumed
from its newest checkpoint with a step budget continues bit for bit as if it had never stopped; a finished stage loads its weights and takes no step, unless it is resumed with a larger
budget (then it continues from where it stopped).
"""

from __future__ import annotations

import json
import logging
import random
import shutil
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from flowalign import checkpoint as ckpt
from flowalign.budget import Budget
from flowalign.ema import EMA
from flowalign.io import atomic_path
from flowalign.logger import RunLogger

log = logging.getLogger("flowalign.pretrain")

#: ``(step, restart_step, budget fraction) -> learning rate``; ``restart_step``: where a finished stage
#: that was given a larger budget started again (0 otherwise)
LRSchedule = Callable[[int, int, float], float]
#: ``budget fraction -> (loss of one training batch, extra scalars to log)``
LossFn = Callable[[float], tuple[torch.Tensor, dict[str, float]]]


@dataclass
class Stage:
    """What a stage trains and for how long. ``modules``: checkpoint prefix → module whose whole
    ``state_dict`` is saved; ``params``: what the optimiser moves (and the EMA averages, if any)."""

    folder: Path
    modules: dict[str, torch.nn.Module]
    params: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    max_steps: int | None
    max_minutes: float | None
    seed: int = 0
    save_every: int = 200
    ema: EMA | None = None
    keep: int = 2
    log_every: int = 25
    grad_clip: float = 1.0
    on_continue: Callable[[], None] | None = field(default=None, repr=False)

    @property
    def name(self) -> str:
        return self.folder.name

    @property
    def finished(self) -> bool:
        return (self.folder / "DONE").is_file()

    # ------------------------------------------------------------------ checkpoints
    def weights(self) -> dict[str, torch.Tensor]:
        # cloned: tied weights (UMT5's shared / embed_tokens) share storage, which safetensors refuses
        return {f"{prefix}.{k}": v.detach().clone().contiguous() for prefix, module in self.modules.items()
                for k, v in module.state_dict().items()}

    def save(self, step: int, budget: Budget, restart_step: int) -> Path:
        root = self.folder / "checkpoints"
        final, tmp = root / ckpt.step_dir_name(step), root / f".tmp-{ckpt.step_dir_name(step)}"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        ckpt.save_rank_rng(tmp, 0)
        ckpt.write_checkpoint_files(tmp, trainable=self.weights(), optimizer=self.optimizer,
                                    ema_state=self.ema.state_dict() if self.ema else None,
                                    trainer_state={"step": step, "elapsed": budget.elapsed,
                                                   "restart_step": restart_step})
        ckpt.finalise(tmp, final)
        ckpt.prune(self.folder, self.keep)
        return final

    def restore(self) -> dict | None:
        """Load the newest complete checkpoint into the modules, optimiser and EMA; its trainer state."""
        folder = ckpt.latest_checkpoint(self.folder)
        if folder is None:
            return None
        saved = ckpt.load_checkpoint(folder)
        for prefix, module in self.modules.items():
            load_prefixed(module, saved["trainable"], prefix)
        self.optimizer.load_state_dict(saved["optimizer"])
        if self.ema is not None:
            self.ema.load_state_dict(saved["ema"])
        ckpt.load_rank_rng(folder, 0)
        log.info("%s: resumed from %s (step %d, %.1f min)", self.name, folder, saved["trainer_state"]["step"],
                 saved["trainer_state"]["elapsed"] / 60)
        return saved["trainer_state"]


def load_prefixed(module: torch.nn.Module, weights: dict[str, torch.Tensor], prefix: str) -> None:
    """Load the ``prefix.*`` tensors of ``weights`` into ``module`` (every one must fit)."""
    state = {k[len(prefix) + 1 :]: v for k, v in weights.items() if k.startswith(prefix + ".")}
    missing, unexpected = module.load_state_dict(state, strict=False)
    if unexpected or [m for m in missing if "embed_tokens" not in m]:  # tied embeddings come back with `shared`
        raise RuntimeError(f"{prefix}: missing {missing[:5]}, unexpected {unexpected[:5]}")


def run_stage(stage: Stage, loss_fn: LossFn, lr_at: LRSchedule, *, resume: bool) -> int:
    """Train ``stage`` until its budget is spent (see the module docstring); returns its final step."""
    state = stage.restore() if (resume or stage.finished) else None
    step, elapsed, restart = (state["step"], state["elapsed"], state["restart_step"]) if state else (0, 0.0, 0)
    budget = Budget(stage.max_steps, stage.max_minutes, elapsed)
    if stage.finished:
        if not resume or budget.done(step):
            return step
        (stage.folder / "DONE").unlink()  # resumed with a larger budget: continue from here
        restart = step
        if stage.on_continue is not None:
            stage.on_continue()
        log.info("%s: continuing a finished stage at step %d up to %s min / %s steps", stage.name, step,
                 stage.max_minutes, stage.max_steps)
    stage.folder.mkdir(parents=True, exist_ok=True)
    logger = RunLogger(stage.folder, enabled=True, tensorboard=False, wandb=False, project="", name="", config={})
    logger.truncate_after(step)
    while not budget.done(step):
        seed_step(stage, step)
        fraction = budget.fraction(step)
        lr = lr_at(step, restart, fraction)
        for group in stage.optimizer.param_groups:
            group["lr"] = lr
        loss, extra = loss_fn(fraction)
        stage.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(stage.params, stage.grad_clip)
        stage.optimizer.step()
        if stage.ema is not None:
            stage.ema.update()
        step += 1
        logger.log(step, {"loss": loss.item(), "lr": lr, "grad_norm": float(grad_norm), **extra})
        if step % stage.log_every == 0:
            log.info("%s step %d loss %.4f lr %.1e elapsed %.1f min", stage.name, step, loss.item(), lr,
                     budget.elapsed / 60)
        if step % stage.save_every == 0:
            stage.save(step, budget, restart)
    stage.save(step, budget, restart)
    with atomic_path(stage.folder / "DONE") as tmp:
        tmp.write_text(json.dumps({"step": step, "minutes": budget.elapsed / 60}) + "\n")
    log.info("%s: done, %d steps in %.1f min", stage.name, step, budget.elapsed / 60)
    return step


def seed_step(stage: Stage, step: int) -> None:
    """Seed torch's and Python's global generators for one step (dropout inside the models draws from them
    too); a generator state restored from a checkpoint would miss torch's cached normal samples."""
    seed = int(np.random.SeedSequence([stage.seed, zlib.crc32(stage.name.encode()), step]).generate_state(1)[0])
    torch.manual_seed(seed)
    random.seed(seed)


def losses(folder: Path) -> list[float]:
    """The per-step losses a stage logged, in step order."""
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [row["loss"] for row in rows]
