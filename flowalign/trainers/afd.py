"""Adversarial Flow Distillation (AFD; ``docs/methods/afd.md``): a streaming student distilled from a black-box
video teacher that shows only completed videos (:mod:`flowalign.trainers.parts.teacher_videos`).

Per step, for each prompt ``c``: the teacher's video ``x_T`` and ``G`` student streams ``x_S^i`` (deterministic
ODE rollouts from different noise). A prompt-paired Bradley-Terry discriminator ``D``
(:mod:`flowalign.trainers.parts.video_discriminator`) takes ``disc_steps`` steps on

    L_D = −mean_i log σ(D(x_T, c) − D(x_S^i, c))

then scores the students. Its log-odds that student ``i`` beats the teacher, ``s_i = D(x_S^i, c) − D(x_T, c)``,
is the reward; the advantage is DiffusionNFT's normalised one (``advantage: global_std``):

    A_i = clip((s_i − mean_{j∈c} s_j) / (std_batch(s) + 1e-4), ±adv_clip),   r_i = A_i/(2·adv_clip) + ½

and the advantage becomes dense denoising-time updates on the student's own clean latents: a chunk ``k`` and
``σ ~ U(sigma_range)`` per draw, ``x_σ = (1 − σ)·x0_k + σ·ε``, the chunk's instantaneous velocity read from
the KV cache of the student's own clean chunks before it, and DiffusionNFT's negative-aware loss
(``loss_form: nft``)

    v± mirrored around v_old:  v⁺ = β·v_θ + (1−β)·v_old,   v⁻ = (1+β)·v_old − β·v_θ
    L = mean_{i,draws} [ r_i·mean_D (v⁺ − (ε − x0_k))² + (1 − r_i)·mean_D (v⁻ − (ε − x0_k))² ]
        + β_reg · mean (v_θ − v_ref)²

with ``v_old`` the velocity of the weights the step starts from (the rollouts' own: one update per batch, so
on-policy ``v_old = sg(v_θ)``), β ``mirror_beta`` and β_reg ``beta``. Its gradient is
``2β·(2r_i − 1)·(v_θ − (ε − x0_k))/D``: toward the students ``D`` finds more teacher-like, away from the others.
``loss_form: weighted_fm`` with ``advantage: centred`` is the former form: ``A_i = clip(s_i − mean_j s_j,
±adv_clip)`` weighting ``mean_D (v_θ − (ε − x0_k))²`` directly. No teacher latents, scores, trajectories or
step alignment are needed, and no reverse-chain log-probability. A discriminator at chance scores every
student of a prompt alike: every ``A_i`` is 0 (``r_i = ½``) and the update is zero.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from pydantic import Field, model_validator

from flowalign.config import Fraction, Section
from flowalign.errors import UserError
from flowalign.limits import MAX_COEFFICIENT, MAX_GROUP_SIZE, MAX_GUIDANCE, MAX_IMAGE_SIDE, MAX_SAMPLING_STEPS, MAX_UPDATES, MAX_WIDTH
from flowalign.sampling.streaming import stream_rollout
from flowalign.trainers.base import GroupTrainer, Plan, derived_seed
from flowalign.trainers.copies import WeightCopy, full_reference
from flowalign.trainers.options import ReferenceOptions, RolloutOptions, TrainerConfig
from flowalign.trainers.parts.teacher_videos import ModelTeacher, VideoFolderTeacher, VideoTeacher
from flowalign.trainers.parts.negative_aware import nft_loss, reward_weight
from flowalign.trainers.parts import stream_calls
from flowalign.trainers.parts.units import GroupUnit
from flowalign.trainers.parts.reductions import per_sample_mean
from flowalign.trainers.parts.video_discriminator import PromptPairedDiscriminator, bradley_terry_loss

#: ``global_std``: DiffusionNFT's normalised advantage of the discriminator's log-odds (the paper's); ``centred``:
#: the log-odds centred per prompt, not divided (the former form)
AdvantageForm = Literal["global_std", "centred"]
#: ``nft``: DiffusionNFT's negative-aware loss in velocity space (the paper's); ``nft_x0_normalised``: the same in
#: the DiffusionNFT authors' code's x0-space, error-normalised form; ``weighted_fm``: advantage-weighted flow
#: matching (the former form)
LossForm = Literal["nft", "nft_x0_normalised", "weighted_fm"]


class TeacherConfig(Section):
    """``trainer.teacher``: exactly one of ``videos`` (a folder with ``videos.jsonl``) or ``model`` (a diffusers
    folder flowalign loads)."""

    #: a folder of completed videos with videos.jsonl ({"prompt": ..., "video": "file.mp4"} per line)
    videos: str | None = None
    #: a diffusers folder of any family flowalign loads, sampled on the training prompts
    model: str | None = None
    #: a model teacher's sampling steps (None: its own default)
    num_steps: int | None = Field(None, ge=1, le=MAX_SAMPLING_STEPS)
    #: a model teacher's CFG scale (None: its own default)
    guidance_scale: float | None = Field(None, ge=1.0, le=MAX_GUIDANCE)

    @model_validator(mode="after")
    def _one_source(self) -> "TeacherConfig":
        if (self.videos is None) == (self.model is None):
            raise ValueError("give exactly one of trainer.teacher.videos (a folder with videos.jsonl) and "
                             "trainer.teacher.model (a diffusers folder)")
        return self


class AFDConfig(TrainerConfig, RolloutOptions, ReferenceOptions):
    """The loop's rollout options (its own streams; the advantages come from the discriminator, so no
    ``advantage`` kind)."""

    name: Literal["afd"] = "afd"
    #: what runs saved before these options existed computed (see TrainerConfig.before)
    before = {"advantage": "centred", "loss_form": "weighted_fm"}
    #: the black-box teacher: {videos: DIR} or {model: FOLDER}
    teacher: TeacherConfig
    #: the student's sampler steps per chunk
    num_steps: int = Field(4, ge=1, le=16)
    #: G student streams per prompt, each paired with the prompt's teacher video
    group_size: int = Field(4, ge=2, le=MAX_GROUP_SIZE)
    #: discriminator Adam steps per training step on the step's pairs (0: a frozen discriminator)
    disc_steps: int = Field(1, ge=0, le=MAX_UPDATES)
    #: the discriminator's Adam learning rate
    disc_lr: float = Field(1e-3, gt=0, le=1)
    #: the discriminator's channel width
    disc_width: int = Field(32, ge=4, le=MAX_WIDTH)
    #: the side the discriminator resizes frames to
    disc_size: int = Field(32, ge=8, le=MAX_IMAGE_SIDE)
    #: forward-process draws (chunk, σ, ε) per student video per step
    train_timesteps: int = Field(2, ge=1, le=MAX_SAMPLING_STEPS)
    #: σ of the forward-process draws, uniform in this range
    sigma_range: tuple[Fraction, Fraction] = (0.05, 0.95)
    #: weight of the velocity-space anchor to the starting weights (the adapter switched off)
    beta: float = Field(0.0, ge=0, le=MAX_COEFFICIENT)
    #: A_max: advantages are clipped to ±adv_clip and (``loss_form: nft``) mapped to r = A/(2·adv_clip) + ½
    #: (DiffusionNFT's 5; the former ``centred`` log-odds were clipped at 2)
    adv_clip: float = Field(5.0, gt=0, le=MAX_COEFFICIENT)
    #: ``global_std``: the discriminator's log-odds minus their prompt's mean, divided by their std over the
    #: step's batch + 1e-4 (DiffusionNFT's normalised advantage, the paper's); ``centred``: minus the prompt's
    #: mean only (the former form)
    advantage: AdvantageForm = "global_std"
    #: ``nft``: DiffusionNFT's negative-aware loss r·‖v⁺ − v‖² + (1 − r)·‖v⁻ − v‖² (the paper's);
    #: ``nft_x0_normalised``: its x0-space, error-normalised form of the DiffusionNFT authors' code;
    #: ``weighted_fm``: A·‖v_θ − v‖² (the former form)
    loss_form: LossForm = "nft"
    #: β of the mirrored velocities v± of ``loss_form: nft`` (DiffusionNFT's 1.0)
    mirror_beta: float = Field(1.0, gt=0, le=MAX_COEFFICIENT)

    @model_validator(mode="after")
    def _sigma_range_inside(self) -> "AFDConfig":
        lo, hi = self.sigma_range
        if not 0 < lo < hi < 1:
            raise ValueError(f"trainer.sigma_range={list(self.sigma_range)}: give 0 < low < high < 1")
        return self


# ---------------------------------------------------------------------------------------------- the math


def discriminator_advantages(student: torch.Tensor, teacher: torch.Tensor, clip: float,
                             form: AdvantageForm = "global_std", scale: torch.Tensor | None = None) -> torch.Tensor:
    """``A (P, G)`` from the log-odds ``s = D_S − D_T`` of students ``student (P, G)`` against their prompt's
    teacher ``teacher (P,)``, clipped to ``±clip``: ``global_std``, ``(s − mean_prompt s)/(σ + 1e-4)`` with ``σ``
    the population std of every ``s`` of the step (``scale``: that std over every rank's log-odds; None: over
    these); ``centred``, ``s − mean_prompt s``. Zero when ``D`` scores a prompt's students alike."""
    s = student - teacher[:, None]
    if form == "centred":
        return (s - s.mean(dim=1, keepdim=True)).clamp(-clip, clip)
    d = s - s[:, :1]  # the prompt's mean taken of differences: exactly 0 for students scored alike
    centred = d - d.mean(dim=1, keepdim=True)
    scale = s.std(unbiased=False) if scale is None else scale
    return (centred / (scale + 1e-4)).clamp(-clip, clip)


def weighted_matching_loss(v: torch.Tensor, target: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
    """``mean_i A_i · mean_D (v_i − target_i)²`` over ``v, target (B, ...)`` and ``advantages (B,)`` (the former
    ``loss_form: weighted_fm``)."""
    return (advantages.to(v, non_blocking=True) * per_sample_mean((v - target.detach()) ** 2)).mean()


def on_policy_nft_loss(v: torch.Tensor, noised: torch.Tensor, clean: torch.Tensor, eps: torch.Tensor, sigma: float,
                       r: torch.Tensor, mirror_beta: float, adv_clip: float,
                       form: LossForm = "nft") -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DiffusionNFT's loss :func:`~flowalign.trainers.parts.negative_aware.nft_loss` ``(B,)`` with the behaviour velocity
    the weights the step starts from, ``v_old = sg(v)`` (one update per batch of the student's own rollouts);
    ``noised = (1 − σ)·clean + σ·eps``; ``r (B,)`` in [0, 1]. ``nft`` is its velocity form, whose gradient is
    ``2β·(2r − 1)·(v − (eps − clean))/D``; ``nft_x0_normalised`` the x0-space form of the authors' code."""
    t = torch.full((len(v),), float(sigma), dtype=v.dtype, device=v.device)
    return nft_loss(v, v.detach(), noised, clean, eps, t, r.to(v), mirror_beta, adv_clip,
                    "velocity" if form == "nft" else "x0_normalised")


# ---------------------------------------------------------------------------------------------- the trainer


@dataclass
class StudentGroup:
    """One prompt's student streams: clean latents ``(G, C, F', H, W)`` and advantages ``(G,)``."""

    prompt: str
    group: int
    latents: torch.Tensor
    advantages: torch.Tensor


@dataclass
class StudentBatch:
    groups: list[StudentGroup]
    logs: dict[str, float] = field(default_factory=dict)


class AFDTrainer(GroupTrainer):
    Config = AFDConfig
    tcfg: AFDConfig
    needs_rewards = False  # rewards, if configured, are only logged
    sampler = "ode"

    @classmethod
    def training_chunks(cls, tcfg: AFDConfig, checkpointed: bool) -> int:
        """A group's streams, one drawn chunk each, ``train_timesteps`` calls in one graph (:meth:`loss`);
        checkpointed, one call at a time."""
        return tcfg.group_size * (1 if checkpointed else tcfg.train_timesteps)

    @classmethod
    def weight_copies(cls, cfg, tcfg) -> list[WeightCopy]:
        """The anchor's reference under full fine-tuning (``beta`` > 0), a model teacher (a whole second
        model on the device) and the discriminator, a small network of its own in CPU memory."""
        reference = full_reference(tcfg) if tcfg.beta > 0 and cfg.model.finetune == "full" else []
        with torch.device("meta"):
            critic = sum(p.numel() for p in PromptPairedDiscriminator(tcfg.disc_width, tcfg.disc_size).parameters())
        return reference + ([WeightCopy("teacher", "model")] if tcfg.teacher.model is not None else []) + \
            [WeightCopy("critic", "own", offloaded=True, params=critic)]

    def __init__(self, *args: Any, **kw: Any):
        super().__init__(*args, **kw)
        if not getattr(self.policy, "streaming", False):
            raise UserError(f"trainer.name=afd distils into a streaming video student, but model.path holds a "
                            f"{self.policy.family!r} model; use a streaming family (such as AnyFlow-FAR)")
        tc = self.tcfg.teacher
        self.teacher: VideoTeacher = (VideoFolderTeacher(tc.videos) if tc.videos is not None else
                                      ModelTeacher(tc.model, self.policy.device, tc.num_steps, tc.guidance_scale))
        self.teacher.check_prompts(list(self.data.prompts))
        with torch.random.fork_rng(devices=[]):  # the same discriminator on every rank, whatever came before
            torch.manual_seed(derived_seed(self.cfg.run.seed, 17))
            self.discriminator = PromptPairedDiscriminator(self.tcfg.disc_width, self.tcfg.disc_size)
        self.disc_optimizer = torch.optim.Adam(self.discriminator.parameters(), lr=self.tcfg.disc_lr, betas=(0.5, 0.999))

    def guidance(self) -> float:
        g = self.tcfg.guidance_scale
        return float(self.policy.defaults.get("guidance_scale", 1.0) if g is None else g)

    def train_discriminator(self, teacher: torch.Tensor, student: torch.Tensor, prompts: list[str]) -> float:
        """``disc_steps`` Adam steps on the prompt-paired pairs (``teacher`` repeated per student); every rank
        averages its gradients with the others (the strategy's collective), so the ranks keep one discriminator."""
        loss = torch.zeros(())
        for _ in range(self.tcfg.disc_steps):
            self.disc_optimizer.zero_grad(set_to_none=False)
            loss = bradley_terry_loss(self.discriminator(teacher, prompts), self.discriminator(student, prompts))
            loss.backward()
            self.parallel.average_gradients(list(self.discriminator.parameters()))
            self.disc_optimizer.step()
        return loss.item()

    def collect(self, step: int) -> StudentBatch:
        tc, g, policy = self.tcfg, self.tcfg.group_size, self.policy
        prompts, metadata, groups = self.step_prompts(step)
        firsts = list(range(0, len(prompts), g))
        seeds = [derived_seed(self.cfg.run.seed, step, int(groups[i]), i % g, 97) for i in range(len(prompts))]
        noise = torch.cat([policy.initial_noise(1, torch.Generator().manual_seed(s)) for s in seeds])
        latents, videos = [], []
        for start in range(0, len(prompts), tc.batch_size):
            part = slice(start, start + tc.batch_size)
            r = stream_rollout(policy, prompts[part], num_steps=tc.num_steps, guidance_scale=self.guidance(),
                               initial_noise=noise[part])
            latents.append(r.final_latents.cpu())
            videos.append(r.samples.cpu())
        student, latents = torch.cat(videos), torch.cat(latents)
        teacher = self.teacher.videos([prompts[i] for i in firsts],
                                      [derived_seed(self.cfg.run.seed, step, int(groups[i]), 98) for i in firsts])
        if teacher.shape[1] != student.shape[1]:
            raise UserError(f"trainer.teacher gives {teacher.shape[1]}-frame videos, the student makes "
                            f"{student.shape[1]}: give teacher videos of the student's frame count (num_frames)")
        paired = teacher.repeat_interleave(g, dim=0)
        disc_loss = self.train_discriminator(paired, student, prompts)
        with torch.no_grad():
            d_student = self.discriminator(student, prompts).view(-1, g)
            d_teacher = self.discriminator(teacher, [prompts[i] for i in firsts])
        scale = None
        if tc.advantage == "global_std":  # the std of every rank's log-odds (a collective)
            scale = self.gather((d_student - d_teacher[:, None]).flatten()).std(unbiased=False)
        advantages = discriminator_advantages(d_student, d_teacher, tc.adv_clip, tc.advantage, scale)
        batch = [StudentGroup(prompts[i], int(groups[i]), latents[i:i + g], advantages[j])
                 for j, i in enumerate(firsts)]
        logs = {"disc/loss": disc_loss,
                "disc/teacher_win_prob": torch.sigmoid(d_teacher[:, None] - d_student).mean().item(),
                "disc/accuracy": (d_teacher[:, None] > d_student).float().mean().item(),
                "afd/advantage_abs": advantages.abs().mean().item(),
                "zero_adv_fraction": (advantages == 0).float().mean().item()}
        if len(self.rewards):  # a verifier to watch, not a training signal
            logs.update(self.score(student, prompts, metadata, step=step).logs)
        return StudentBatch(batch, logs)

    def plan(self, batch: StudentBatch, generator: torch.Generator) -> Plan:
        """One optimiser step over every group, a unit each."""
        total = self.total(len(batch.groups))
        return Plan([[GroupUnit(i, total) for i in range(len(batch.groups))]], global_weights=True)

    def loss(self, batch: StudentBatch, unit: GroupUnit) -> tuple[torch.Tensor, dict[str, float]]:
        """The forward-process loss of one prompt's students: DiffusionNFT's (``loss_form: nft``, on the reward
        weights ``r``) or the former advantage-weighted flow matching (``weighted_fm``), plus the anchor."""
        tc, policy = self.tcfg, self.policy
        group = batch.groups[unit.index]
        x0 = group.latents.to(policy.device, non_blocking=True)
        n = len(x0)
        cond = policy.encode([group.prompt] * n)
        gen = self.keyed_generator(group.group, 99)
        lo, hi = tc.sigma_range
        total, mse = torch.zeros((), device=policy.device), []
        for _ in range(tc.train_timesteps):
            k = int(torch.randint(len(policy.chunk_frames), (1,), generator=gen))
            sigma = lo + (hi - lo) * float(torch.rand((), generator=gen))
            clean = x0[:, :, policy.chunk_slice(k)]
            eps = torch.randn(clean.shape, generator=gen).to(clean, non_blocking=True)
            noised = (1 - sigma) * clean + sigma * eps
            cache = policy.history_cache(x0[:, :, :policy.chunk_slice(k).start], range(k), cond, 1.0)
            v = stream_calls.chunk_velocity(policy, self.cfg.model.gradient_checkpointing, noised, sigma, sigma, cache,
                                            cond, 1.0)
            if tc.loss_form == "weighted_fm":
                term = weighted_matching_loss(v, eps - clean, group.advantages)
            else:
                r = reward_weight(group.advantages, tc.adv_clip)
                term = on_policy_nft_loss(v, noised, clean, eps, sigma, r, tc.mirror_beta, tc.adv_clip,
                                          tc.loss_form)[0].mean()
            if tc.beta > 0:
                with torch.no_grad(), policy.adapter_disabled():
                    v_ref = policy.chunk_velocity(noised, sigma, sigma, cache, cond, 1.0)
                term = term + tc.beta * ((v - v_ref) ** 2).mean()
            total = total + term / tc.train_timesteps
            mse.append(per_sample_mean((v.detach() - (eps - clean)) ** 2).mean())
        return total / unit.total, {"afd_loss": total.detach(), "matching_mse": torch.stack(mse).mean()}

    def state_dict(self) -> dict[str, Any]:
        """The discriminator and its Adam state: a resumed run continues with the same critic."""
        state: dict[str, Any] = {f"discriminator.{k}": v.detach().clone()
                                 for k, v in self.discriminator.state_dict().items()}
        for i, s in self.disc_optimizer.state_dict()["state"].items():
            state.update({f"discriminator_adam.{i}.{k}": torch.as_tensor(v).clone() for k, v in s.items()})
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        own = {k[len("discriminator."):]: v for k, v in state.items() if k.startswith("discriminator.")}
        self.discriminator.load_state_dict(own)
        adam: dict[int, dict[str, torch.Tensor]] = {}
        for key, value in state.items():
            if key.startswith("discriminator_adam."):
                _, i, name = key.split(".", 2)
                adam.setdefault(int(i), {})[name] = value.clone()
        groups = self.disc_optimizer.state_dict()["param_groups"]
        self.disc_optimizer.load_state_dict({"state": adam, "param_groups": groups})
