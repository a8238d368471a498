"""Flow-OPD: on-policy distillation of several single-reward teachers into one student
(``docs/methods/flow_opd.md``).

Stage 1 trains one teacher per reward with any single-reward trainer (their run folders' checkpoints are
the teachers). Stage 2, this trainer:

- **cold start** (the first ``cold_start_steps`` steps): each teacher samples its own domain's prompts
  (ODE) and the student fits those samples with the flow-matching loss,
  ``mean‖v_θ((1−t)·x0_T + t·ε, t) − (ε − x0_T)‖²``;
- **on-policy distillation** (after): the student rolls out (ODE, ``num_steps``); each prompt is routed to
  the teacher of its domain (``teachers[i].match``, a regular expression on the prompt; the first match
  wins); at every visited state the routed teacher's velocity is the student's target, and a task-agnostic
  anchor (the starting weights, or ``anchor`` weights) supervises every prompt (Manifold Anchor
  Regularisation):

      L_i = 1[i routed] · mean_k ‖v_θ(x_k) − v_T(i)(x_k)‖² + λ · mean_k ‖v_θ(x_k) − v_A(x_k)‖²

with ``λ = anchor_weight`` and both targets detached (teacher weights swapped in, no gradient).
"""

from __future__ import annotations

import re
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from flowalign.errors import UserError
from flowalign.limits import MAX_COEFFICIENT, MAX_GROUP_SIZE, MAX_SAMPLING_STEPS, MAX_TRAIN_STEPS
from flowalign.paths import REPO_ROOT
from flowalign.protocols import Conditioning
from flowalign.saved_weights import load_adapter_checked
from flowalign.trainers.base import GroupTrainer, Plan, SliceUnit, derived_seed, slice_plan
from flowalign.trainers.copies import WeightCopy, full_reference
from flowalign.trainers.options import ReferenceOptions, RolloutOptions, TrainerConfig
from flowalign.trainers.parts.timesteps import pair_timesteps
from flowalign.trainers.rollouts import roll_out, rollout_batches, sample_slots
from flowalign.trainers.parts.reductions import per_sample_mean
from flowalign.weight_swap import swapped_in


class Teacher(BaseModel):
    model_config = ConfigDict(extra="forbid")
    #: a stage-1 run folder (its newest whole checkpoint), one of its checkpoints/step-N, or a saved adapter
    adapter: str
    #: the reward this teacher was trained on (a name in rewards:; the domain's score is logged under it)
    reward: str | None = None
    #: its domain: prompts this regular expression finds (re.search); None: every prompt
    match: str | None = None


class FlowOPDConfig(TrainerConfig, RolloutOptions, ReferenceOptions):
    """The loop's rollout options (each rollout distilled on its own: no advantages)."""

    name: Literal["flow_opd"] = "flow_opd"
    #: the stage-1 teachers, each supervising its own domain's prompts
    teachers: list[Teacher] = Field(min_length=1)
    #: the Manifold Anchor Regularisation teacher: a checkpoint folder, or None for the starting weights
    anchor: str | None = None
    #: λ, the anchor term's weight on every prompt (0: no anchor)
    anchor_weight: float = Field(0.1, ge=0, le=MAX_COEFFICIENT)
    #: steps of the flow-based cold start (flow matching on the teachers' own samples) before distillation
    cold_start_steps: int = Field(20, ge=0, le=MAX_TRAIN_STEPS)
    #: visited states trained per rollout (drawn at random per sample and step); None: all num_steps
    states_per_sample: int | None = Field(None, ge=1, le=MAX_SAMPLING_STEPS)
    #: student rollouts per prompt (no group statistics: each is distilled on its own)
    group_size: int = Field(1, ge=1, le=MAX_GROUP_SIZE)


# ---------------------------------------------------------------------------------------------- pieces


def route(prompts: list[str], patterns: list[str | None]) -> torch.Tensor:
    """``(N,)`` the index of the first teacher whose pattern finds each prompt (None matches all), −1 for none."""
    compiled = [None if p is None else re.compile(p) for p in patterns]
    out = []
    for prompt in prompts:
        out.append(next((i for i, c in enumerate(compiled) if c is None or c.search(prompt)), -1))
    return torch.tensor(out, dtype=torch.long)


def distillation_loss(v: torch.Tensor, v_teacher: torch.Tensor, v_anchor: torch.Tensor | None, routed: torch.Tensor,
                      anchor_weight: float) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-sample ``1[routed]·mean‖v − sg(v_T)‖² + λ·mean‖v − sg(v_A)‖²`` ``(B,)`` for velocities ``(B, ...)``."""
    teacher = per_sample_mean((v - v_teacher.detach()) ** 2) * routed.to(v)
    loss, info = teacher, {"loss_teacher": teacher.mean().item()}
    if v_anchor is not None and anchor_weight > 0:
        anchor = per_sample_mean((v - v_anchor.detach()) ** 2)
        loss = loss + anchor_weight * anchor
        info["loss_anchor"] = anchor.mean().item()
    return loss, info


# ---------------------------------------------------------------------------------------------- hooks


@dataclass
class DistillBatch:
    """This rank's states and targets: ``x (B, S, ...)`` at ``sigma (B, S)`` with the teacher and anchor
    velocities there (cold start: S = 1, the teacher's samples noised, the target ε − x0), ``routed (B,)``."""

    x: torch.Tensor
    sigma: torch.Tensor
    v_teacher: torch.Tensor
    v_anchor: torch.Tensor | None
    routed: torch.Tensor
    cond: Conditioning
    #: the CFG scale the student's velocity is read at (the teachers' in distillation; 1 in the cold start)
    guidance: float
    logs: dict[str, Any] = field(default_factory=dict)


class FlowOPDTrainer(GroupTrainer):
    Config = FlowOPDConfig
    tcfg: FlowOPDConfig
    needs_rewards = False
    sampler = "ode"

    @classmethod
    def weight_copies(cls, cfg, tcfg) -> list[WeightCopy]:
        """The teachers (each a copy of the trained tensors, read from its checkpoint), and the anchor: a
        checkpoint's copy likewise, or the starting weights (a full fine-tune keeps them frozen)."""
        teachers = [WeightCopy("teacher", count=len(tcfg.teachers))]
        if tcfg.anchor is not None:
            return teachers + [WeightCopy("teacher")]
        return teachers + (full_reference(tcfg) if cfg.model.finetune == "full" else [])

    @classmethod
    def check_config(cls, cfg, tcfg) -> None:
        names = [r.name for r in cfg.rewards]
        for i, t in enumerate(tcfg.teachers):
            if t.reward is not None and t.reward not in names:
                raise UserError(f"trainer.teachers[{i}].reward={t.reward!r} is not one of the run's rewards "
                                f"({', '.join(names) or 'none'}); add it to rewards: (weight 0 logs it only) or drop it")
            if t.match is not None:
                try:
                    re.compile(t.match)
                except re.error as e:
                    raise UserError(f"trainer.teachers[{i}].match={t.match!r} is not a regular expression ({e})")

    def __init__(self, cfg, tcfg, policy, *args: Any, **kw: Any):
        # the teachers' weights are read into the unsharded policy, before the loop shards it
        named = {n: p for n, p in policy.trainable.named_parameters() if p.requires_grad}
        teachers = [read_weights(policy, named, t.adapter, f"trainer.teachers[{i}].adapter")
                    for i, t in enumerate(tcfg.teachers)]
        anchor = read_weights(policy, named, tcfg.anchor, "trainer.anchor") if tcfg.anchor else None
        super().__init__(cfg, tcfg, policy, *args, **kw)
        names = [n for n, p in self.policy.trainable.named_parameters() if p.requires_grad]
        if len(names) != len(self.params):
            raise RuntimeError("the trainable parameters changed while the loop set up")
        place = self.parallel.place
        self.teachers = [[place(t[n], p) for n, p in zip(names, self.params)] for t in teachers]
        self.anchor = None if anchor is None else [place(anchor[n], p) for n, p in zip(names, self.params)]
        self.patterns = [t.match for t in tcfg.teachers]
        # a teacher no training prompt is routed to (its match finds none, or an earlier teacher takes them
        # all) would sit in memory unused: say so before training
        routed = set(route(self.data.prompts, self.patterns).tolist())
        for i, t in enumerate(tcfg.teachers):
            if i not in routed and self.acc.is_main_process:
                print(f"warning: trainer.teachers[{i}] ({t.adapter}, match={t.match!r}) is the first match of none "
                      f"of the {len(self.data.prompts)} training prompts, so it is never used; fix its match (a "
                      "regular expression searched in each prompt) or its place in the list, or drop it")

    def anchor_weights(self):
        """The anchor's velocity context: its weights swapped in, or the adapter switched off."""
        if self.anchor is not None:
            return swapped_in(self.params, self.anchor)
        return self.policy.adapter_disabled()

    def velocity_under(self, weights: list[torch.Tensor] | None, x: torch.Tensor, sigma: torch.Tensor,
                       cond: Conditioning) -> torch.Tensor:
        """``v`` ``(B, S, ...)`` at each of the ``S`` states ``x (B, S, ...)``, ``sigma (B, S)``, under ``weights``
        (None: the anchor), no gradient; the weights are swapped in once for all states."""
        with torch.no_grad(), (self.anchor_weights() if weights is None else swapped_in(self.params, weights)):
            return torch.stack([self.policy.velocity(x[:, s], sigma[:, s], cond, self.guidance())
                                for s in range(x.shape[1])], dim=1)

    def guidance(self) -> float:
        g = self.tcfg.guidance_scale
        return float(self.policy.defaults.get("guidance_scale", 1.0) if g is None else g)

    def rollouts(self, prompts: list[str], metadata: list[dict], step: int, weights: list[torch.Tensor] | None,
                 places: list[int]):
        """ODE rollouts of ``prompts`` under ``weights`` (None: the live weights), each keyed by its place in
        this rank's step batch (``places``), so no rank layout or routing changes a sample's noise."""
        n = self.tcfg.prompts_per_step * self.tcfg.group_size  # every rank holds as many
        groups = torch.tensor([self.rank * n + j for j in places])
        slots = sample_slots(self.policy, prompts, metadata, groups, groups, self.cfg.run.seed, step, False)
        sampling = {int(g): self.sampling(int(g)) for g in groups}
        with torch.no_grad(), swapped_in(self.params, weights) if weights is not None else nullcontext():
            return [roll_out(self.policy, b, sampling[b[0].group], self.tcfg.num_steps, self.tcfg.guidance_scale)
                    for b in rollout_batches(slots, sampling, self.tcfg.batch_size)]

    def collect(self, step: int) -> DistillBatch:
        prompts, metadata, _ = self.step_prompts(step)
        routed_to = route(prompts, self.patterns)
        cond = self.policy.encode(prompts)
        batch = self.cold_start(prompts, metadata, routed_to, cond, step) if step < self.tcfg.cold_start_steps \
            else self.on_policy(prompts, metadata, routed_to, cond, step)
        for i, t in enumerate(self.tcfg.teachers):
            batch.logs[f"route/teacher{i}_fraction"] = (routed_to == i).float().mean().item()
        return batch

    def cold_start(self, prompts, metadata, routed_to, cond, step) -> DistillBatch:
        """Each prompt's teacher sample (the anchor's where none is routed) noised at a logit-normal t; the
        target is its flow-matching velocity ε − x0, fitted by the conditional velocity."""
        samples: dict[int, torch.Tensor] = {}
        for i in sorted(set(routed_to.tolist())):
            members = (routed_to == i).nonzero().flatten().tolist()
            chosen = ([prompts[j] for j in members], [metadata[j] for j in members], step)
            if i >= 0 or self.anchor is not None:
                chunks = self.rollouts(*chosen, self.teachers[i] if i >= 0 else self.anchor, members)
            else:
                with self.policy.adapter_disabled():
                    chunks = self.rollouts(*chosen, None, members)
            samples.update(zip(members, torch.cat([c.final_latents for c in chunks])))
        x0 = torch.stack([samples[j] for j in range(len(prompts))]).float()
        p = len(prompts)
        t, eps = [], []
        for n in range(p):
            g = torch.Generator().manual_seed(derived_seed(self.cfg.run.seed, step, self.rank * p + n, 79))
            t.append(pair_timesteps(1, "logit_normal", g))
            eps.append(torch.randn(x0.shape[1:], generator=g))
        t, eps = torch.cat(t).to(x0), torch.stack(eps).to(x0)
        tb = t.view(-1, *[1] * (x0.ndim - 1))
        return DistillBatch(((1 - tb) * x0 + tb * eps)[:, None], t[:, None], (eps - x0)[:, None], None,
                            torch.ones(len(prompts)), cond, 1.0, {"stage": 0.0})

    def on_policy(self, prompts, metadata, routed_to, cond, step) -> DistillBatch:
        """The student's own ODE states, each labelled by its routed teacher and by the anchor."""
        chunks = self.rollouts(prompts, metadata, step, None, list(range(len(prompts))))
        latents = torch.cat([c.latents[:, :-1] for c in chunks])  # (B, T, ...): the states a velocity is read at
        sigmas = chunks[0].sigmas[:-1]
        n_states = self.tcfg.states_per_sample or len(sigmas)
        p = len(prompts)
        picks = []
        for n in range(p):
            g = torch.Generator().manual_seed(derived_seed(self.cfg.run.seed, step, self.rank * p + n, 83))
            picks.append(torch.randperm(len(sigmas), generator=g)[:n_states].sort().values)
        picks = torch.stack(picks)
        x = torch.stack([latents[n, picks[n]] for n in range(len(prompts))]).to(self.policy.device)
        sigma = sigmas[picks].to(x)
        v_teacher, v_anchor = torch.zeros_like(x), torch.zeros_like(x) if self.tcfg.anchor_weight > 0 else None
        for i in sorted(set(routed_to.tolist()) - {-1}):
            m = (routed_to == i).nonzero().flatten()
            v_teacher[m] = self.velocity_under(self.teachers[i], x[m], sigma[m], cond[m])
        if v_anchor is not None:
            v_anchor = self.velocity_under(None, x, sigma, cond)
        logs: dict[str, Any] = {"stage": 1.0}
        if len(self.rewards):
            scored = self.score(torch.cat([c.samples for c in chunks]), prompts, metadata, step=step)
            logs.update(scored.logs)
            logs.update(self.domain_logs(scored.scores, routed_to))
        return DistillBatch(x, sigma, v_teacher, v_anchor, (routed_to >= 0).float(), cond, self.guidance(), logs)

    def domain_logs(self, scores: Any, routed_to: torch.Tensor) -> dict[str, float]:
        """``domain/<i>/<reward>``: each teacher's reward on the student's samples of its own domain (every
        rank's valid samples). A collective."""
        values, valid, routes = self.gather(scores.values), self.gather(scores.valid), self.gather(routed_to)
        logs = {}
        for i, t in enumerate(self.tcfg.teachers):
            if t.reward is not None:
                m = valid.bool() & (routes == i)
                column = values[:, scores.names.index(t.reward)]
                logs[f"domain/{i}/{t.reward}"] = column[m].mean().item() if m.any() else float("nan")
        return logs

    def plan(self, batch: DistillBatch, generator: torch.Generator) -> Plan:
        """One optimiser step over every sample, in micro-batches of ``batch_size``."""
        return slice_plan(self, len(batch.x))

    def loss(self, batch: DistillBatch, unit: SliceUnit) -> tuple[torch.Tensor, dict[str, float]]:
        """The unit's samples at each of their states, averaged over the states."""
        i = unit.index
        x, sigma, cond = batch.x[i], batch.sigma[i], batch.cond[i]
        per = torch.zeros(len(x), device=x.device)
        stats: dict[str, float] = {}
        for s in range(x.shape[1]):
            v = self.policy.velocity(x[:, s], sigma[:, s], cond, batch.guidance)
            anchor = None if batch.v_anchor is None else batch.v_anchor[i][:, s]
            loss, info = distillation_loss(v, batch.v_teacher[i][:, s], anchor, batch.routed[i], self.tcfg.anchor_weight)
            per = per + loss / x.shape[1]
            for k, val in info.items():
                stats[k] = stats.get(k, 0.0) + val / x.shape[1]
        return per.sum() / unit.total, stats



def read_weights(policy: Any, named: dict[str, torch.nn.Parameter], folder: str,
                 source: str = "trainer.teachers") -> dict[str, torch.Tensor]:
    """A teacher's trainable tensors by name: its checkpoint loaded into the live policy, copied out, and the
    live weights put back (``source``: the config field that named ``folder``, for errors)."""
    live = {n: p.detach().clone() for n, p in named.items()}
    try:
        load_adapter_checked(policy, teacher_checkpoint(Path(folder)), source)
        return {n: p.detach().clone() for n, p in named.items()}
    finally:
        with torch.no_grad():
            for n, p in named.items():
                p.copy_(live[n])


def teacher_checkpoint(path: Path) -> Path:
    """A run folder's newest checkpoint that verifies; any other folder as it is. (Checked here, when training
    starts, not with the config: ``flowalign plan`` and ``--check`` of a stage-2 run work before stage 1.)
    A relative path that is not found from here is read from the repository, as configs name shipped assets."""
    if not path.exists() and not path.is_absolute() and (REPO_ROOT / path).exists():
        path = REPO_ROOT / path
    if not path.exists():
        raise UserError(f"trainer.teachers: adapter {str(path)!r} does not exist; train the teacher first (stage 1) "
                        "and give its run folder or checkpoint, e.g. runs/<name>/checkpoints/step-N")
    if not (path / "checkpoints").is_dir():
        return path
    from flowalign.checkpoint_manifest import resume_folder

    newest = resume_folder(path, "auto", main=False)
    if newest is None:
        raise UserError(f"trainer.teachers: the run {path} has no whole checkpoint yet; train it (stage 1) first")
    return newest
