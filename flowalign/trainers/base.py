"""The shared training loop: prompts → grouped rollouts → rewards → advantages → update.

A trainer subclasses :class:`GroupTrainer` and overrides only the phases it changes (usually ``sample``
and ``loss``). The loop owns the rest: distributed set-up, deterministic batches, reward masking,
gradient accumulation and clipping, EMA, evaluation, logging, checkpoints and resume.

Determinism: the prompts and the sampling noise of a step are pure functions of ``(run.seed, step,
rank)``, so a run resumed from a checkpoint ends at the same weights as one never interrupted.
"""

from __future__ import annotations

import math
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from pydantic import Field
from tqdm.auto import tqdm

from flowalign import checkpoint as ckpt
from flowalign.advantages import compute_advantages
from flowalign.config import Section, TrainConfig
from flowalign.data import PromptSet
from flowalign.ema import EMA
from flowalign.errors import UserError
from flowalign.logger import RunLogger
from flowalign.parallel import Parallel
from flowalign.protocols import FlowPolicy, RewardOutput
from flowalign.sampling import Rollout, rollout


class GroupTrainerConfig(Section):
    """Options every group-sampling trainer shares (``trainer:`` section)."""

    name: str
    max_steps: int = Field(100, ge=1)
    #: also stop once this many minutes were spent training (evaluations excluded); None: no limit
    max_minutes: float | None = Field(None, gt=0)
    lr: float = Field(1e-4, gt=0)
    #: "cosine": decay to lr_min_ratio·lr by the end of the budget (max_steps, or max_minutes when that
    #: ends the run first; a time-based schedule makes the LR depend on measured step times)
    lr_schedule: Literal["constant", "cosine"] = "constant"
    lr_warmup_steps: int = Field(0, ge=0)
    lr_min_ratio: float = Field(0.1, ge=0, le=1)
    weight_decay: float = Field(1e-4, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float = Field(1.0, gt=0)
    #: prompts per step on each rank; each is sampled group_size times
    prompts_per_step: int = Field(4, ge=1)
    group_size: int = Field(8, ge=2)
    #: rollout chunk = training chunk (outputs depend on batch size, so they must match)
    batch_size: int = Field(8, ge=1)
    #: rollout steps T (evaluation uses eval.num_steps or the model's default)
    num_steps: int = Field(10, ge=2)
    guidance_scale: float | None = None
    inner_epochs: int = Field(1, ge=1)
    #: optimiser steps per pass over the batch (gradients accumulate over samples x trained steps)
    updates_per_epoch: int = Field(1, ge=1)
    #: DanceGRPO's grouping: every rollout of a prompt group starts from the same initial noise, so the
    #: rewards within a group differ only through the SDE steps the loss trains (not through x_T, which
    #: no log-probability credits)
    shared_initial_noise: bool = False
    advantage: str = Field("global_std", pattern="^(group|global_std|gdpo|win_rate)$")
    adv_clip: float = Field(5.0, gt=0)
    ema_decay: float = Field(0.0, ge=0, lt=1)
    ema_every: int = Field(8, ge=1)


@dataclass
class StepBatch:
    """One step's rollouts on this rank, kept as the chunks they were sampled in."""

    chunks: list[Rollout]
    groups: torch.Tensor  # (N,) global group id of each sample

    @property
    def samples(self) -> torch.Tensor:
        return torch.cat([c.samples for c in self.chunks])

    @property
    def prompts(self) -> list[str]:
        return [p for c in self.chunks for p in c.prompts]

    @property
    def metadata(self) -> list[dict[str, Any]]:
        return [m for c in self.chunks for m in c.metadata]


def derived_seed(*parts: int) -> int:
    """A 63-bit seed from integers, stable across processes (no ``hash()``)."""
    return int(np.random.SeedSequence([abs(int(p)) for p in parts]).generate_state(2, dtype=np.uint64)[0] >> 1)


class GroupTrainer:
    """Rollout → reward → advantage → update, with the bookkeeping around it."""

    Config: type[GroupTrainerConfig] = GroupTrainerConfig

    def __init__(
        self,
        cfg: TrainConfig,
        tcfg: GroupTrainerConfig,
        policy: FlowPolicy,
        rewards: list[tuple[str, float, Any]],
        data: PromptSet,
        evaluator: Any,
        accelerator: Any,
        run_dir: Path,
    ):
        self.cfg, self.tcfg, self.policy = cfg, tcfg, policy
        self.rewards, self.data, self.evaluator = rewards, data, evaluator
        self.acc, self.run_dir = accelerator, run_dir
        self.rank, self.world = accelerator.process_index, accelerator.num_processes
        self.parallel = Parallel(cfg.parallel, self.world, self.rank, accelerator.device)
        self.parallel.shard(policy.trainable)  # fsdp: before the parameters are collected (they become shards)
        self.params = [p for p in policy.trainable.parameters() if p.requires_grad]
        if not self.params:
            raise UserError("the policy has no trainable parameters; set model.finetune to lora or full")
        self.optimizer = torch.optim.AdamW(self.params, lr=tcfg.lr, betas=tcfg.betas, weight_decay=tcfg.weight_decay)
        self.ema = EMA(self.params, tcfg.ema_decay, tcfg.ema_every) if tcfg.ema_decay > 0 else None
        self.step = 0
        self.train_seconds = 0.0
        self.lr_now = tcfg.lr
        self.logger = RunLogger(
            run_dir, enabled=accelerator.is_main_process, tensorboard=cfg.run.tensorboard, wandb=cfg.run.wandb,
            project=cfg.run.wandb_project, name=cfg.run.name, config=cfg.model_dump(mode="json"),
        )

    @classmethod
    def check_config(cls, cfg: TrainConfig, tcfg: GroupTrainerConfig) -> None:
        """Refuse (``UserError``) settings this trainer cannot honour with the rest of ``cfg``, e.g. a
        reference-model term under full fine-tuning; called before the run folder is touched."""

    # ------------------------------------------------------------------ phases
    sampler: Any = "flow_grpo"
    noise_level: float | None = None

    def sample(self, prompts: list[str], metadata: list[dict], groups: torch.Tensor) -> StepBatch:
        """Grouped SDE rollouts. Each group's noise comes from its own generator seeded by (run seed,
        step, group id), so samples do not depend on how groups are spread over ranks."""
        chunks = []
        for gid in torch.unique_consecutive(groups).tolist():
            idx = (groups == gid).nonzero().flatten().tolist()
            generator = torch.Generator().manual_seed(derived_seed(self.cfg.run.seed, self.step, gid))
            chunks += self.sample_group(gid, [prompts[i] for i in idx], [metadata[i] for i in idx], generator)
        return StepBatch(chunks, groups)

    def sample_group(self, gid: int, prompts: list[str], metadata: list[dict], generator: torch.Generator,
                     **kw: Any) -> list[Rollout]:
        """One prompt group in chunks of ``batch_size`` (a chunk never spans two groups); ``kw`` goes to
        every chunk's rollout. Under ``shared_initial_noise`` the whole group starts from one ``x_T``."""
        b = self.tcfg.batch_size
        noise = None
        if self.tcfg.shared_initial_noise:
            x_T = self.policy.initial_noise(1, generator)
            noise = x_T.expand(len(prompts), *x_T.shape[1:]).clone()
        return [self.rollout_chunk(prompts[i : i + b], metadata[i : i + b], generator,
                                   initial_noise=None if noise is None else noise[i : i + b], **kw)
                for i in range(0, len(prompts), b)]

    def rollout_chunk(self, prompts: list[str], metadata: list[dict], generator: torch.Generator, **kw: Any) -> Rollout:
        return rollout(self.policy, prompts, num_steps=self.tcfg.num_steps, sampler=kw.pop("sampler", self.sampler),
                       noise_level=self.noise_level, guidance_scale=self.tcfg.guidance_scale, generator=generator,
                       metadata=metadata, **kw)

    def score(self, batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
        """Weighted reward components ``(N, M)``, a validity mask ``(N,)`` and per-reward means."""
        samples, prompts, metadata = batch.samples, batch.prompts, batch.metadata
        columns, valid, logs = [], torch.ones(len(prompts), dtype=torch.bool), {}
        for name, _, reward in self.rewards:
            try:
                out: RewardOutput = reward(samples, prompts, metadata)
                value = out.total.float().cpu()
                ok = out.valid.cpu() & torch.isfinite(value)
            except Exception as e:  # a reward that raises invalidates the batch's samples, not the run
                print(f"warning: reward {name!r} raised {type(e).__name__}: {e}")
                value, ok = torch.zeros(len(prompts)), torch.zeros(len(prompts), dtype=torch.bool)
            columns.append(torch.where(ok, value, torch.zeros_like(value)))
            valid &= ok
            logs[f"reward/{name}"] = value[ok].mean().item() if ok.any() else float("nan")
            logs[f"reward/{name}_invalid_fraction"] = 1.0 - ok.float().mean().item()
        return torch.stack(columns, dim=1), valid, logs

    def advantages(self, components: torch.Tensor, valid: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
        """Advantages from rewards gathered over all ranks; invalid samples get 0 (dropped)."""
        comps, ok, gids = (self.acc.gather(t.to(self.acc.device)).cpu() for t in (components, valid, groups))
        weights = torch.tensor([w for _, w, _ in self.rewards])
        # an invalid sample takes its group's valid mean, so it neither moves nor receives the statistics
        filled = comps.clone()
        for g in torch.unique(gids):
            members = gids == g
            good = members & ok
            if good.any():
                filled[members & ~ok] = comps[good].mean(0)
        adv = compute_advantages(self.tcfg.advantage, filled, weights, gids, clip=self.tcfg.adv_clip)
        adv[~ok] = 0.0
        n = components.shape[0]
        return adv[self.rank * n : (self.rank + 1) * n]

    def update(self, batch: StepBatch, adv: torch.Tensor, generator: torch.Generator) -> dict[str, float]:
        """Inner epochs over the chunks; one optimiser step per ``1/updates_per_epoch`` of the batch."""
        stats: dict[str, list[float]] = {}
        sizes = [len(c) for c in batch.chunks]
        adv_chunks = list(torch.split(adv, sizes))
        for _ in range(self.tcfg.inner_epochs):
            order = torch.randperm(len(batch.chunks), generator=generator).tolist()
            active = [i for i in order if adv_chunks[i].abs().sum() > 0]
            if not active and not self.parallel.sharded:
                continue
            parts = [p for p in np.array_split(np.array(active, dtype=int), self.tcfg.updates_per_epoch) if len(p)]
            for part in self.parallel.padded(parts, lambda: np.array([], dtype=int)):  # fsdp: as many steps per rank
                units = self.loss_units(batch, part.tolist(), generator) if len(part) else []
                # fsdp: every forward is a collective, so a rank with fewer units runs zero-weighted ones
                filler = self.parallel.padded(units, lambda: (order[0], self.trained_steps(batch.chunks[order[0]])[0]))
                for n, (i, k) in enumerate(filler):
                    loss, info = self.loss(batch.chunks[i], k, adv_chunks[i])
                    if n >= len(units):
                        (loss * 0).backward()
                        continue
                    (loss / len(units)).backward()
                    for key, value in info.items():
                        stats.setdefault(key, []).append(value)
                stats.setdefault("grad_norm", []).append(self.optimizer_step())
        return {k: float(np.mean(v)) for k, v in stats.items()}

    def loss_units(self, batch: StepBatch, chunk_ids: list[int], generator: torch.Generator) -> list[tuple[int, int]]:
        """The (chunk, step) pairs one optimiser step accumulates over."""
        return [(i, k) for i in chunk_ids for k in self.trained_steps(batch.chunks[i])]

    def trained_steps(self, chunk: Rollout) -> list[int]:
        return chunk.trained_steps()

    def loss(self, chunk: Rollout, k: int, adv: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        raise NotImplementedError

    def budget_fraction(self) -> float:
        """How much of the run's budget is spent, in [0, 1]: steps, or training minutes (slowest rank)."""
        fraction = self.step / self.tcfg.max_steps
        if self.tcfg.max_minutes is not None:
            fraction = max(fraction, self.slowest_train_seconds() / (60 * self.tcfg.max_minutes))
        return min(1.0, fraction)

    def learning_rate(self, fraction: float) -> float:
        """The LR at a budget fraction (linear warm-up over ``lr_warmup_steps``, then the schedule)."""
        t = self.tcfg
        lr = t.lr
        if t.lr_schedule == "cosine":
            lr *= t.lr_min_ratio + (1 - t.lr_min_ratio) * 0.5 * (1 + math.cos(math.pi * fraction))
        if self.step < t.lr_warmup_steps:
            lr *= (self.step + 1) / t.lr_warmup_steps
        return lr

    def optimizer_step(self) -> float:
        """Average gradients over ranks, clip, step, update the EMA. Returns the pre-clip norm."""
        if self.world > 1 and not self.parallel.sharded:  # fsdp reduce-scatters gradients during backward
            for p in self.params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                p.grad = self.acc.reduce(p.grad, reduction="mean")
        norm = self.parallel.clip_grad_norm(self.params, self.tcfg.grad_clip)
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr_now
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.ema is not None:
            self.ema.update()
        return norm

    # ------------------------------------------------------------------ loop
    def step_prompts(self, step: int) -> tuple[list[str], list[dict], torch.Tensor]:
        """This rank's prompts of a step, each repeated group_size times, with global group ids."""
        p, g = self.tcfg.prompts_per_step, self.tcfg.group_size
        idx = self.data.batch_indices(self.cfg.run.seed, step, p * self.world)[self.rank * p : (self.rank + 1) * p]
        prompts = [self.data.prompts[i] for i in idx for _ in range(g)]
        metadata = [self.data.metadata[i] for i in idx for _ in range(g)]
        groups = torch.arange(self.rank * p, (self.rank + 1) * p).repeat_interleave(g)
        return prompts, metadata, groups

    def train_step(self) -> dict[str, float]:
        t0 = time.perf_counter()
        prompts, metadata, groups = self.step_prompts(self.step)
        batch = self.sample(prompts, metadata, groups)
        t_sample = time.perf_counter()
        components, valid, reward_logs = self.score(batch)
        invalid = 1.0 - valid.float().mean().item()
        if invalid > self.cfg.run.max_invalid_fraction:
            raise UserError(
                f"step {self.step}: {invalid:.0%} of the samples have invalid rewards (limit "
                f"run.max_invalid_fraction={self.cfg.run.max_invalid_fraction}); check the reward"
            )
        adv = self.advantages(components, valid, groups)
        t_reward = time.perf_counter()
        generator = torch.Generator().manual_seed(derived_seed(self.cfg.run.seed, self.step, self.rank, 1))
        stats = self.update(batch, adv, generator)
        total = components @ torch.tensor([w for _, w, _ in self.rewards])
        all_total, all_valid = (self.acc.gather(t.to(self.acc.device)).cpu() for t in (total, valid))
        logs = {
            "reward/total": all_total[all_valid].mean().item() if all_valid.any() else float("nan"),
            **reward_logs,
            "reward/invalid_fraction": invalid,
            "zero_adv_fraction": (adv == 0).float().mean().item(),
            "time/sample": t_sample - t0,
            "time/reward": t_reward - t_sample,
            "time/update": time.perf_counter() - t_reward,
            "time/step": time.perf_counter() - t0,
            **{f"train/{k}": v for k, v in stats.items()},
        }
        return logs

    def train(self) -> dict[str, Any]:
        """Run until ``trainer.max_steps``.

        Ctrl-C finishes the step in flight, saves a checkpoint and raises KeyboardInterrupt (a second
        Ctrl-C stops at once): a checkpoint never holds half an update.
        """
        self.maybe_resume()
        bar = tqdm(total=self.tcfg.max_steps, initial=self.step, desc="training", unit="step",
                   disable=not (self.acc.is_main_process and self.cfg.run.progress))
        stop = {"requested": False}

        def request_stop(signum, frame):
            if stop["requested"]:
                raise KeyboardInterrupt
            stop["requested"] = True
            print("\ninterrupt: finishing this step, then saving a checkpoint (Ctrl-C again to stop now)")

        previous = signal.signal(signal.SIGINT, request_stop) if threading.current_thread() is threading.main_thread() else None
        try:
            if self.step == 0 and self.cfg.eval.at_start:
                self.evaluate()
            while self.step < self.tcfg.max_steps and not self.out_of_time():
                if stop["requested"]:
                    self.save_checkpoint()
                    raise KeyboardInterrupt
                self.lr_now = self.learning_rate(self.budget_fraction())
                logs = self.train_step()
                logs["train/lr"] = self.lr_now
                self.train_seconds += logs["time/step"]
                self.step += 1
                logs["time/train_minutes"] = self.train_seconds / 60
                if self.step % self.cfg.run.log_every == 0:
                    self.logger.log(self.step, logs)
                bar.set_postfix(reward=f"{logs.get('reward/total', float('nan')):.3f}", step_s=f"{logs['time/step']:.1f}")
                bar.update(1)
                last = self.step >= self.tcfg.max_steps or self.out_of_time()  # the final evaluation follows
                if self.cfg.eval.every and self.step % self.cfg.eval.every == 0 and not last:
                    self.evaluate()
                if self.step % self.cfg.run.checkpoint_every == 0:
                    self.save_checkpoint()
        finally:
            bar.close()
            if previous is not None:
                signal.signal(signal.SIGINT, previous)
        final = self.evaluate()
        self.save_checkpoint()
        self.logger.close()
        return final

    def out_of_time(self) -> bool:
        """Whether the training-time budget is spent (the slowest rank decides, so all ranks stop together)."""
        limit = self.tcfg.max_minutes
        return limit is not None and self.slowest_train_seconds() >= limit * 60

    def slowest_train_seconds(self) -> float:
        """Training seconds so far on the slowest rank (the same number on every rank)."""
        seconds = torch.tensor([self.train_seconds], device=self.acc.device)
        if self.world > 1:
            seconds = self.acc.reduce(seconds, reduction="max")
        return float(seconds)

    def evaluate(self) -> dict[str, Any]:
        """Held-out evaluation (EMA weights when enabled) into ``evals/step-XXXXXX/`` and the gallery."""
        if self.evaluator is None:
            return {}
        metrics: dict[str, Any] = {}
        if self.acc.is_main_process or self.parallel.sharded:  # fsdp: every rank joins every forward
            with self.parallel.rank_folder(self.run_dir) as folder:  # other ranks write to a scratch folder
                out_dir = folder / "evals" / ckpt.step_dir_name(self.step)
                if self.ema is not None and self.step > 0:
                    with self.ema.swapped_in():
                        metrics = self.evaluator(self.policy, out_dir)
                else:
                    metrics = self.evaluator(self.policy, out_dir)
        if self.acc.is_main_process:
            scalars = {f"eval/{k}": v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
            self.logger.log(self.step, scalars)
        self.acc.wait_for_everyone()
        return metrics

    # ------------------------------------------------------------------ checkpoints
    def trainable_state(self) -> dict[str, torch.Tensor]:
        return {n: p for n, p in self.policy.trainable.named_parameters() if p.requires_grad}

    def save_checkpoint(self) -> Path:
        final = self.run_dir / "checkpoints" / ckpt.step_dir_name(self.step)
        tmp = self.run_dir / "checkpoints" / f".tmp-{ckpt.step_dir_name(self.step)}"
        if self.acc.is_main_process:
            if tmp.exists():
                import shutil

                shutil.rmtree(tmp)
            tmp.mkdir(parents=True)
        self.acc.wait_for_everyone()
        checksums = self.rank_checksums()
        ckpt.save_rank_rng(tmp, self.rank)
        # fsdp: every rank takes part in gathering full tensors and writes its optimiser shard
        trainable = self.parallel.gather(self.trainable_state())
        ema_state = self.parallel.gather(self.ema.state_dict()) if self.ema else None
        sharded_optimizer = self.parallel.save_optimizer(tmp, self.policy.trainable, self.optimizer)
        if self.cfg.model.finetune == "lora" and (self.acc.is_main_process or self.parallel.sharded):
            with self.parallel.rank_folder(tmp) as folder:
                self.policy.save_adapter(folder)
        if self.acc.is_main_process:
            ckpt.write_checkpoint_files(
                tmp, trainable=trainable, optimizer=None if sharded_optimizer else self.optimizer,
                ema_state=ema_state,
                trainer_state={"step": self.step, "world_size": self.world, "trainer": self.tcfg.name,
                               "rank_checksums": checksums, "train_seconds": self.train_seconds},
            )
            self.write_checkpoint_extras(tmp)
        self.acc.wait_for_everyone()
        if self.acc.is_main_process:
            ckpt.finalise(tmp, final)
            ckpt.prune(self.run_dir, self.cfg.run.keep_checkpoints)
        self.acc.wait_for_everyone()
        return final

    def write_checkpoint_extras(self, folder: Path) -> None:
        """Trainer-specific files (main process), written before the checkpoint is marked complete."""

    def rank_checksums(self) -> list[float]:
        """Sum of the trainable weights on every rank; ranks that diverged are an error, not a warning."""
        local = self.parallel.checksum(self.params)
        sums = self.acc.gather(local.to(self.acc.device)).cpu().tolist()
        if len(set(sums)) > 1:
            raise RuntimeError(f"step {self.step}: ranks hold different weights (checksums {sums})")
        return sums

    def maybe_resume(self) -> None:
        resume = self.cfg.run.resume
        if resume == "never":
            return
        folder = ckpt.latest_checkpoint(self.run_dir) if resume == "auto" else Path(resume)
        if folder is None:
            return
        if not (folder / ckpt.COMPLETE).exists():
            raise UserError(f"run.resume={resume}: {folder} is not a complete checkpoint folder (no {ckpt.COMPLETE})")
        state = ckpt.load_checkpoint(folder)
        live = self.trainable_state()
        missing = set(live) - set(state["trainable"])
        if missing:
            raise UserError(f"checkpoint {folder} does not match this model ({len(missing)} trainable tensors missing)")
        saved = self.parallel.place_like(state["trainable"], live)  # fsdp: this rank's shards
        with torch.no_grad():
            for name, p in live.items():
                p.copy_(saved[name])
        self.parallel.load_optimizer(folder, self.policy.trainable, self.optimizer, state["optimizer"])
        if self.ema is not None and state["ema"] is not None:
            self.ema.load_state_dict(self.parallel.place_like(state["ema"], self.ema.state_dict()))
        ckpt.load_rank_rng(folder, self.rank)
        self.step = int(state["trainer_state"]["step"])
        self.train_seconds = float(state["trainer_state"].get("train_seconds", 0.0))
        self.logger.truncate_after(self.step)
        if self.acc.is_main_process:
            print(f"resumed from {folder} at step {self.step}")
