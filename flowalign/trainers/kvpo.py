"""KVPO (*KVPO: ODE-Native GRPO for Autoregressive Video Alignment via KV Semantic Exploration*;
``docs/methods/kvpo.md``) for streaming policies that can route their history
(:meth:`flowalign.protocols.StreamingPolicy.history_cache`), with the authors' training rule
(Richard-Zhang-AI/KVPO @ 7703196) as the default.

Exploration moves the *history*, not the noise. Per prompt, the deterministic stream runs once with its full
history (the *anchor*); at a chunk ``k`` each of ``G`` branches, from the same noise and prefix, attends to a
routed history over a window of chunks (:mod:`flowalign.trainers.parts.kv_routing`: the sink, the nearest
frames and older frames drawn per branch, in frames where the model's cache routes frames, else in whole
chunks), then finishes with its full history. Branches and anchor are
scored; a branch's advantage is its reward against the anchor's
(:mod:`flowalign.trainers.parts.anchor_advantages`).

The policy over the branches replays each one's window under the full history
(:mod:`flowalign.trainers.parts.branch_policy`): ``s_i = Σ_chunks Σ_t −mse(x̂0_branch − x̂0_θ)/(2·max(σ_t, 1)²)``
(gradient through the first ``grad_steps`` steps), ``π = softmax(s)``, and the clipped ratio to ``π_old`` with a
KL to the initial weights' ``π``, halved by the anchor slot when no branch beat the anchor. The earlier form
(one routed chunk, each history chunk kept with ``keep_prob``; the velocity energy ``−E/τ``; group advantages;
a symmetric clip) stays available through ``routing``, ``score``, ``advantage`` and the clip and KL options.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar, Literal

import torch
from pydantic import Field, model_validator

from flowalign.config import StepIndex, changed
from flowalign.errors import UserError
from flowalign.limits import MAX_COEFFICIENT
from flowalign.protocols import KeptFrames
from flowalign.sampling.streaming import StreamPrefix, stream_rollout, switched_history
from flowalign.trainers.base import GroupTrainer, Plan, derived_seed
from flowalign.trainers.copies import WeightCopy, full_reference
from flowalign.trainers.options import (
    AdvantageOptions,
    ReferenceOptions,
    StreamOptions,
    TrainerConfig,
)
from flowalign.trainers.parts.anchor_advantages import fused_anchor_advantages
from flowalign.trainers.parts.branch_policy import (
    branch_objective,
    velocity_energy,
    x0_scores,
)
from flowalign.trainers.parts.frame_window import FrameWindow
from flowalign.trainers.parts.kv_routing import (
    bernoulli_routing,
    window_keep,
    window_routable,
    window_routings,
)
from flowalign.trainers.parts import stream_calls
from flowalign.trainers.parts.prompt_segments import PromptSegments, segment_bounds
from flowalign.trainers.parts.units import GroupUnit

#: a count of latent frames
LatentFrames = Annotated[int, Field(ge=1, le=100_000)]

#: options that only one form reads: {option: (the field choosing the form, the form that reads it)}
FORM_OPTIONS = {"keep_prob": ("routing", "bernoulli"), "nearest_chunks": ("routing", "window"),
                "older_chunks": ("routing", "window"), "window_chunks": ("routing", "window"),
                "nearest_frames": ("routing", "window"), "older_frames": ("routing", "window"),
                "resident_frames": ("routing", "window"), "pool_reads": ("routing", "window"),
                "temperature": ("score", "velocity_energy"), "sigma_floor": ("score", "x0_sigma"),
                "local_weight": ("advantage", "anchor"), "global_weight": ("advantage", "anchor"),
                "local_layout": ("advantage", "anchor"),
                "global_frames": ("advantage", "anchor")}


class KVPOConfig(TrainerConfig, StreamOptions, AdvantageOptions, ReferenceOptions):
    """KVPO's own routed branches (``StreamOptions``) and their anchor; the authors' rule by default."""

    name: Literal["kvpo"] = "kvpo"
    #: what runs saved before the two reward signals computed: the whole video as one signal at weight 1
    before: ClassVar[dict[str, Any]] = {"local_weight": 0.0, "global_weight": 1.0, "global_frames": None}
    refused: ClassVar[dict[str, str]] = {
        "clip_range": "the clip is asymmetric now: give trainer.clip_low and trainer.clip_high (the ratio is clipped "
                      "to [1 − clip_low, 1 + clip_high]; the earlier symmetric 0.2 is clip_low: 0.2, clip_high: 0.2)"}
    #: "window": the authors' (sink, nearest chunks and drawn older chunks, held over window_chunks chunks);
    #: "bernoulli": each earlier chunk kept with keep_prob, at the routed chunk only
    routing: Literal["window", "bernoulli"] = "window"
    #: always keep the first chunk (the attention sink streaming models rely on)
    keep_sink: bool = True
    #: window, in whole chunks: the most recent chunks every branch keeps (theirs: 4 frames)
    nearest_chunks: int = Field(1, ge=0, le=64)
    #: window, in whole chunks: older chunks each branch draws in place of the rest of its history (theirs: 5
    #: frames)
    older_chunks: int = Field(2, ge=0, le=64)
    #: window, in frames (theirs; a model whose cache routes single frames, a causal Wan): the most recent frames
    #: every branch reads, the chunk being made among them (theirs: m_nearest_frames 4); None: route whole chunks
    nearest_frames: int | None = Field(None, ge=1, le=4096)
    #: window, in frames: older frames each branch draws (None: the model's attention window less its sink and
    #: nearest_frames, theirs: 12 − 3 − 4 = 5)
    older_frames: int | None = Field(None, ge=0, le=4096)
    #: window, in frames: the frames the stream's resident cache holds, the sink's included: the pool keeps the
    #: frames still held when the window's last chunk is made (theirs: local_attn_size + slice_last_frames = 33);
    #: None: every frame
    resident_frames: int | None = Field(None, ge=1, le=100_000)
    #: window, in frames: the entries a drawn frame is read from. "code": as their perturbed window's cache slots
    #: give them (once their rolling cache is full at the routed chunk, frames up to a chunk later than drawn: the
    #: slot arithmetic counts the chunk being made as history); "planned": the drawn frames themselves
    pool_reads: Literal["code", "planned"] = "code"
    #: window: consecutive chunks the drawn history is held for (theirs: 5 blocks), cut at the stream's end
    window_chunks: int = Field(5, ge=1, le=64)
    #: bernoulli: probability that a history chunk stays in a branch's KV cache
    keep_prob: float = Field(0.5, ge=0, le=1)
    #: "x0_sigma": the authors' Σ_t −mse(x0)/(2·max(σ_t, sigma_floor)²); "velocity_energy": −mean mse(v)/temperature
    score: Literal["x0_sigma", "velocity_energy"] = "x0_sigma"
    #: x0_sigma: the σ floor of the score's weights (theirs: 1, every step's x0 error weighed alike)
    sigma_floor: float = Field(1.0, ge=0, le=MAX_COEFFICIENT)
    #: velocity_energy: τ of softmax(−E/τ)
    temperature: float = Field(0.05, gt=0, le=MAX_COEFFICIENT)
    #: the first steps of each chunk whose velocities carry gradient (the rest only set the value); None: all
    grad_steps: int | None = Field(2, ge=1, le=16)
    #: the ratio's lower clip: r ≥ 1 − clip_low (theirs 0.1)
    clip_low: float = Field(0.1, ge=0, lt=1)
    #: the ratio's upper clip: r ≤ 1 + clip_high (theirs 0.2)
    clip_high: float = Field(0.2, ge=0, le=MAX_COEFFICIENT)
    #: β of KL(π_θ ‖ π_init) over the branches (π_init: the starting weights, the adapter switched off)
    kl_coef: float = Field(10.0, ge=0, le=MAX_COEFFICIENT)
    #: chunks whose history may be routed (default: every chunk the routing can change, within 1..K−1)
    route_chunks: list[StepIndex] | None = None
    #: "anchor": the authors' reward against the unrouted stream's, per reward, std-normalised, ±adv_clip
    advantage: str = Field("anchor", pattern="^(anchor|group|global_std|gdpo)$")
    adv_clip: float = Field(2.5, gt=0, le=MAX_COEFFICIENT)
    #: anchor: the weight of the *local* signal, the rewards of the routed chunk's own frames (theirs: the
    #: perturbed chunk, advantage_fusion_local_weight 1.0); 0: no local signal
    local_weight: float = Field(1.0, ge=0, le=MAX_COEFFICIENT)
    #: anchor: the local signal scores the chunk of this streaming layout [first, then] (latent frames: a first
    #: chunk, then chunks of ``then``) holding the routed chunk (theirs: streaming_chunk_size 21,
    #: streaming_min_new_frame 18, the frames before the fork in it included); None: the routed chunk alone
    local_layout: tuple[LatentFrames, LatentFrames] | None = None
    #: anchor: the weight of the *global* signal, the rewards of the whole video's clip (theirs:
    #: advantage_fusion_global_weight 0.5); 0: no global signal
    global_weight: float = Field(0.5, ge=0, le=MAX_COEFFICIENT)
    #: anchor: decoded frames of the global signal's clip, centred on the video, or on each prompt segment
    #: (theirs: long_reward_normal_clip_len 36); None: the whole video (each whole segment)
    global_frames: int | None = Field(36, ge=1, le=100_000)
    #: streams that switch prompts (theirs: switch_frame_indices 39, 75, 111): the latent frames where each
    #: prompt's next segment starts (a JSONL prompt file's "prompts" lists, LongLive's); None: one prompt a video
    switch_frames: list[StepIndex] | None = None

    @model_validator(mode="after")
    def _options_of_the_chosen_form(self) -> KVPOConfig:
        for option, (chooser, form) in FORM_OPTIONS.items():
            if changed(self, option) and getattr(self, chooser) != form:
                raise ValueError(f"trainer.{option} is read only with trainer.{chooser}={form} (this config has "
                                 f"{getattr(self, chooser)}): drop it or set trainer.{chooser}={form}")
        if self.nearest_frames is None:
            given = [o for o in ("older_frames", "resident_frames") if getattr(self, o) is not None]
            if given:
                raise ValueError(f"trainer.{given[0]} is read when routing in frames: set trainer.nearest_frames "
                                 "(theirs: 4) or drop it")
        else:
            given = [o for o in ("nearest_chunks", "older_chunks") if changed(self, o)]
            if given:
                raise ValueError(f"trainer.{given[0]} counts whole chunks, but trainer.nearest_frames routes in "
                                 f"frames: drop trainer.{given[0]} (trainer.older_frames is the frame count)")
        if self.advantage == "anchor" and self.local_weight == 0 and self.global_weight == 0:
            raise ValueError("trainer.local_weight and trainer.global_weight are both 0: no reward signal is left; "
                             "give one of them a positive weight (theirs: 1.0 and 0.5)")
        return self


def layout_span(frame: int, first: int, then: int, total: int) -> tuple[int, int]:
    """The latent frames [s, e) of the chunk holding ``frame`` in a streaming layout of a first chunk of ``first``
    frames and then chunks of ``then`` frames, the last cut at ``total`` (their ``_compute_chunk_layout``)."""
    if frame < first:
        return 0, min(first, total)
    start = first + (frame - first) // then * then
    return start, min(start + then, total)


def kept_fraction(keep: tuple[int, ...] | KeptFrames, chunk: int, start: int) -> float:
    """The share of chunk ``chunk``'s history (its ``chunk`` chunks, or ``start`` frames) a routing keeps."""
    return len(keep.frames) / start if isinstance(keep, KeptFrames) else len(keep) / chunk


def middle_frames(videos: torch.Tensor, frames: int | None, bounds: tuple[int, int] | None = None) -> torch.Tensor:
    """The ``frames`` frames ``(B, frames, 3, H, W)`` of videos ``(B, F, 3, H, W)`` centred on the frames
    ``bounds`` = [a, b) (default: the whole video; the authors' ``_make_clip_window`` around ``(a + b) // 2``,
    moved back inside the video); the frames [a, b) themselves when ``frames`` is None, and the videos
    themselves when ``frames`` is not below ``F``."""
    total = videos.shape[1]
    a, b = (0, total) if bounds is None else bounds
    if frames is None:
        return videos if (a, b) == (0, total) else videos[:, a:b]
    if frames >= total:
        return videos
    start = max(0, (a + b) // 2 - frames // 2)
    end = min(start + frames, total)
    start = max(0, end - frames)
    return videos[:, start:end]


@dataclass
class BranchGroup:
    """One prompt's branches routed from chunk ``chunk``: the shared prefix ``(1, C, F_{<k}, H, W)``, each window
    chunk's states ``(G, T+1, C, f_c, H, W)`` and the velocities its steps took ``(G, T, C, f_c, H, W)``
    (:meth:`flowalign.sampling.streaming.StreamRollout.taken_velocities`), the history each branch kept at
    ``chunk``, advantages ``(G,)``,
    the branch logits at sampling ``(G,)`` and at the starting weights (or None), and whether a branch beat
    the anchor."""

    prompt: str
    chunk: int
    prefix: torch.Tensor
    states: list[torch.Tensor]
    taken: list[torch.Tensor]
    routings: list[tuple[int, ...] | KeptFrames]
    advantages: torch.Tensor
    old_scores: torch.Tensor
    init_scores: torch.Tensor | None = None
    safe: bool = True
    #: a stream that switched prompts: ``(first chunk, prompt)`` of each segment up to the routed chunk (the
    #: routed chunk's segment is ``prompt``); empty: one prompt throughout
    history: list[tuple[int, str]] = field(default_factory=list)


@dataclass
class BranchBatch:
    groups: list[BranchGroup]
    logs: dict[str, float] = field(default_factory=dict)


class KVPOTrainer(GroupTrainer):
    Config = KVPOConfig
    tcfg: KVPOConfig
    sampler = "ode"

    def __init__(self, *args: Any, **kw: Any):
        super().__init__(*args, **kw)
        tc = self.tcfg
        if not hasattr(self.policy, "history_cache"):
            raise UserError(f"trainer.name=kvpo routes a streaming video model's KV cache, but model.path holds a "
                            f"{self.policy.family!r} model; use a streaming family whose policy routes its history "
                            "(such as AnyFlow-FAR)")
        chunks = len(self.policy.chunk_frames)
        routable = list(range(1, chunks)) if tc.route_chunks is None else list(tc.route_chunks)
        bad = [k for k in routable if not 1 <= k < chunks]
        if bad or not routable:
            raise UserError(f"trainer.route_chunks={tc.route_chunks}: this model streams {chunks} chunks; "
                            f"a routed chunk needs a history, so give indices in 1..{chunks - 1}")
        self.frames = FrameWindow.of(self.policy, tc) if tc.routing == "window" and tc.nearest_frames else None
        if self.frames is not None:
            routable = [k for k in routable if self.frames.routable(k, self.window(k))]
            if not routable:
                raise UserError(f"trainer.nearest_frames={tc.nearest_frames}: no chunk of this model's {chunks} "
                                f"starts after its attention window ({self.frames.window} frames) with "
                                f"{self.frames.older} older frames to draw after the sink and the nearest "
                                "frames (within trainer.resident_frames); lower trainer.older_frames or "
                                "trainer.nearest_frames, or stream a longer video")
        elif tc.routing == "window":
            routable = [k for k in routable if window_routable(k, tc.nearest_chunks, tc.older_chunks, tc.keep_sink)]
            if not routable:
                raise UserError(f"trainer.older_chunks={tc.older_chunks}: no chunk of this model's {chunks} has more "
                                f"than {tc.older_chunks} older chunks after the sink (keep_sink={tc.keep_sink}) and "
                                f"the {tc.nearest_chunks} nearest, so routing would change nothing: lower "
                                "trainer.older_chunks or trainer.nearest_chunks, or set trainer.keep_sink=false")
        self.segments = PromptSegments.of(self.policy, tc.switch_frames, self.data.metadata)
        if self.segments:  # a routed window reads one prompt's history (theirs: inside one streaming chunk)
            routable = [k for k in routable if not self.segments.crosses(k, self.window(k))]
            if not routable:
                raise UserError(f"trainer.switch_frames={tc.switch_frames}: every routed window of "
                                f"{tc.window_chunks} chunks would cross a prompt switch; route chunks whose window "
                                "ends before the next switch (trainer.route_chunks) or lower trainer.window_chunks")
        self.route_chunks = routable

    @classmethod
    def weight_copies(cls, cfg: Any, tcfg: KVPOConfig) -> list[WeightCopy]:
        """The KL's π_init under full fine-tuning comes from a frozen copy of the starting weights."""
        return full_reference(tcfg) if tcfg.kl_coef > 0 and cfg.model.finetune == "full" else []

    @classmethod
    def training_chunks(cls, tcfg: KVPOConfig, checkpointed: bool) -> int:
        """The branches' window chunks (at most ``window_chunks``) at their first ``grad_steps`` steps, all in one
        graph (:meth:`scores`), a call of ``G`` rows a chunk and step; checkpointed, one call at a time."""
        calls = tcfg.window_chunks * min(tcfg.grad_steps or tcfg.num_steps, tcfg.num_steps)
        return tcfg.group_size * (1 if checkpointed else calls)

    @classmethod
    def step_holdings(cls, tcfg: KVPOConfig) -> Any:
        """What a step holds per prompt (a :class:`flowalign.plan_holdings.StepHoldings`). Per prompt, the anchor stream (the deterministic stream with its full history: every chunk's
        ``T + 1`` float32 latents and its conditioning; log-probabilities in CPU memory) is held while its ``G``
        branches are streamed one at a time and decoded; the branch videos are kept in a list, concatenated and
        scored (``2G`` decoded), and under ``advantage: anchor`` the anchors are decoded and scored beside them
        (one more each). Every branch's window states and prefix go to CPU memory: nothing of the step stays on
        the device through the update. The anchor keeps its cache at the routed chunk (the history its branches
        fork from and π_old and π_init replay), and the branch being streamed keeps its own while it streams (two
        streams' caches, as the family sizes them). With a local signal
        the routed chunks of the branches and the anchor are decoded and scored too (``G + 1`` more, each counted
        as a whole video: high by the share of the other chunks)."""
        from flowalign.plan_holdings import Holding, StepHoldings

        anchor = {"latents": tcfg.num_steps + 1, "conditionings": 1}
        anchor_video = 1 if tcfg.advantage == "anchor" else 0
        local = tcfg.group_size + 1 if tcfg.advantage == "anchor" and tcfg.local_weight > 0 else 0
        return StepHoldings(Holding(), (Holding(**anchor, decoded=tcfg.group_size, decoding=True, kv_caches=2),
                                        Holding(**anchor, decoded=2 * tcfg.group_size + anchor_video + local,
                                                kv_caches=1)))

    def guidance(self) -> float:
        g = self.tcfg.guidance_scale
        return float(self.policy.defaults.get("guidance_scale", 1.0) if g is None else g)

    @contextmanager
    def initial_weights(self) -> Iterator[None]:
        """Inside: the policy is the starting weights (the adapter off, or a full fine-tune's frozen copy)."""
        with torch.no_grad(), self.policy.adapter_disabled():
            yield

    # ------------------------------------------------------------------ routing

    def branch_routes(self, chunk: int, generator: torch.Generator
                      ) -> list[Callable[[int], tuple[int, ...] | KeptFrames]]:
        """Per branch, what chunk ``c ≥ chunk`` attends to: chunks, or frames (:class:`KeptFrames`) when routing in
        frames (the full history after the routed window)."""
        tc, g = self.tcfg, self.tcfg.group_size
        if tc.routing == "bernoulli":
            kept = [bernoulli_routing(chunk, tc.keep_prob, tc.keep_sink, generator) for _ in range(g)]
            return [lambda c, keep=keep: keep if c == chunk else tuple(range(c)) for keep in kept]
        if self.frames is not None:
            return self.frames.routes(chunk, self.window(chunk), g, generator)
        end = chunk + self.window(chunk)
        return [lambda c, drawn=drawn: (window_keep(c, drawn, tc.nearest_chunks, tc.keep_sink) if c < end
                                        else tuple(range(c)))
                for drawn in window_routings(chunk, g, tc.nearest_chunks, tc.older_chunks, tc.keep_sink, generator)]

    def window(self, chunk: int) -> int:
        """The chunks a routing at ``chunk`` holds for, and the policy replays."""
        if self.tcfg.routing == "bernoulli":
            return 1
        return min(self.tcfg.window_chunks, len(self.policy.chunk_frames) - chunk)

    # ------------------------------------------------------------------ the branch policy

    def history(self, group: BranchGroup) -> Any:
        """The full history's cache at the routed chunk, written by the current weights as the stream wrote it
        (recached where a multi-prompt stream switched prompts)."""
        policy, guidance = self.policy, self.guidance()
        clean = group.prefix.to(policy.device, non_blocking=True).float()
        if group.history:
            return switched_history(policy, clean, [(c, policy.encode([p])) for c, p in group.history], guidance)
        return policy.history_cache(clean, range(group.chunk), policy.encode([group.prompt]), guidance)

    def scores(self, group: BranchGroup, grad: bool = True, history: Any = None) -> torch.Tensor:
        """The branch logits ``(G,)``: each window chunk replayed under the full history (``history``, the
        anchor's cache at the routed chunk as sampling wrote it, which their replay reads for every policy,
        ``kv_state_before_fork``; else written anew by :meth:`history`, the same cache while the weights are the
        sampling ones), then the policy's own clean prediction of the window chunks before it (as their replay
        re-caches), summed."""
        policy, guidance, tc = self.policy, self.guidance(), self.tcfg
        g = len(group.routings)
        cond = policy.encode([group.prompt] * g)
        sigmas = policy.sigmas(tc.num_steps).float()
        last = tc.num_steps - 1
        cache = (self.history(group) if history is None else history).repeat_interleave(g)
        clean = group.prefix.to(policy.device, non_blocking=True).float().repeat_interleave(g, dim=0)
        total = torch.zeros(g, device=policy.device)
        for w, states in enumerate(group.states):
            c = group.chunk + w
            if w:  # the window chunk before joins the full history (a causal model writes it alone)
                cache = policy.append_chunks(cache, clean, cond, guidance)
            states = states.to(policy.device, non_blocking=True)
            v = []
            for t in range(tc.num_steps):
                with torch.set_grad_enabled(grad and (tc.grad_steps is None or t < tc.grad_steps)):
                    v.append(stream_calls.chunk_velocity(policy, self.cfg.model.gradient_checkpointing, states[:, t],
                                                         sigmas[t].item(), sigmas[t + 1].item(), cache, cond,
                                                         guidance))
            v = torch.stack(v, dim=1)
            u = group.taken[w].to(policy.device, non_blocking=True)
            total = total + (x0_scores(v, u, sigmas, tc.sigma_floor) if tc.score == "x0_sigma"
                             else -velocity_energy(v, u) / tc.temperature)
            clean = torch.cat([clean, states[:, last] - sigmas[last].item() * v[:, last].detach()], dim=2)
        return total

    # ------------------------------------------------------------------ the loop's hooks

    def collect(self, step: int) -> BranchBatch:
        """Per prompt: the anchor stream, a routed chunk, G branches routed from it, rewards and advantages, and
        the branch logits at the sampling (and starting) weights."""
        tc, g, policy, guidance = self.tcfg, self.tcfg.group_size, self.policy, self.guidance()
        prompts, metadata, groups = self.step_prompts(step)
        firsts = list(range(0, len(prompts), g))
        noise = torch.cat([policy.initial_noise(1, torch.Generator().manual_seed(
            derived_seed(self.cfg.run.seed, step, int(groups[i]), 0, 91))) for i in firsts])
        # one anchor stream a prompt, as each branch is one: a group's numbers are then the same whichever rank
        # layout (how many prompts a rank batches) ran it, which the anchor advantages' normalisation would amplify
        rngs = [torch.Generator().manual_seed(derived_seed(self.cfg.run.seed, step, int(groups[i]), 0, 93))
                for i in firsts]
        routed = [self.route_chunks[int(torch.randint(len(self.route_chunks), (1,), generator=r))] for r in rngs]
        # each anchor keeps the cache its branches fork from (a resident cache then holds its window's frames only)
        anchors = [stream_rollout(policy, [prompts[i]], num_steps=tc.num_steps, guidance_scale=guidance,
                                  initial_noise=noise[j:j + 1], decode=False,
                                  switches=self.segments.switches(metadata[i]),
                                  keep_caches=(routed[j],))
                   for j, i in enumerate(firsts)]
        branched, samples, kept, chunks, forks = [], [], [], [], []
        for j, i in enumerate(firsts):
            rng, k = rngs[j], routed[j]
            history = self.segments.history(metadata[i], k)
            forks.append(history[-1][1] if history else prompts[i])  # the prompt the routed chunk follows
            prefix, cond = anchors[j].prefix(k), policy.encode([forks[-1]])
            routes, states = self.branch_routes(k, rng), []
            for route in routes:
                # a cache written once is routed as the anchor wrote it (the same entries); else re-encoded
                cache = (policy.reroute(prefix.cache, route(k)) if hasattr(policy, "reroute")
                         else policy.history_cache(prefix.clean, route(k), cond, guidance))
                branch = stream_rollout(policy, [prompts[i]], num_steps=tc.num_steps, guidance_scale=guidance,
                                        initial_noise=noise[j:j + 1], prefix=StreamPrefix(prefix.clean, cache),
                                        route=route, decode=False, switches=self.segments.switches(metadata[i]),
                                        keep_caches=())
                with torch.no_grad():
                    samples.append(policy.decode(branch.final_latents))
                states.append([(branch.chunks[c][0], branch.taken_velocities(c)[0])
                               for c in range(k, k + self.window(k))])
                chunks.append(branch.final_latents[:, :, self.local_span(k)])
                kept.append(kept_fraction(route(k), k, policy.chunk_slice(k).start))
            window = [(torch.stack([s for s, _ in chunk]).cpu(), torch.stack([u for _, u in chunk]).cpu())
                      for chunk in zip(*states)]
            branched.append((forks[-1], k, prefix.clean.cpu(), [s for s, _ in window], [u for _, u in window],
                             [r(k) for r in routes], history))
        advantages, safe, logs = self.advantages(torch.cat(samples), anchors, chunks, routed, prompts, metadata,
                                                 firsts, step, forks)
        batch = []
        for j, (*parts, history) in enumerate(branched):
            group = BranchGroup(*parts, advantages[j * g:(j + 1) * g].float(), torch.zeros(g), safe=safe[j],
                                history=history)
            written = anchors[j].caches[group.chunk]  # the history sampling wrote, read by both replays here
            with torch.no_grad():
                old = self.scores(group, grad=False, history=written).cpu()  # π_old: the weights that sampled
            init = None
            if tc.kl_coef > 0:
                with self.initial_weights():
                    init = self.scores(group, grad=False, history=written).cpu()
            batch.append(dataclasses.replace(group, old_scores=old, init_scores=init))
        logs.update({"kvpo/kept_fraction": sum(kept) / len(kept),
                     "kvpo/score": torch.stack([b.old_scores.mean() for b in batch]).mean().item()})
        return BranchBatch(batch, logs)

    def advantages(self, samples: torch.Tensor, anchors: list[Any], chunks: list[torch.Tensor], routed: list[int],
                   prompts: list[str], metadata: list[dict], firsts: list[int], step: int, forks: list[str],
                   ) -> tuple[torch.Tensor, list[bool], dict[str, float]]:
        """Advantages ``(N,)`` of the branch videos ``samples``, whether each group beat its anchor, and the
        reward logs (of the branches' whole videos). ``anchor``: the authors' rule, each branch against its
        group's anchor stream (``anchors``, one a group) on two signals, the routed chunk's frames (``chunks``:
        each branch's clean frames of :meth:`local_span` ``(1, C, f, H, W)``, ``routed``: each group's chunk k,
        scored with the prompt it followed, ``forks``) and the whole video's clip (:meth:`global_signal`), fused
        (:func:`fused_anchor_advantages`); a group beat its anchor when a branch's weighted reward is above the
        anchor's on either signal. Otherwise the loop's group advantages (every group counts as having beaten its
        anchor)."""
        g, tc = self.tcfg.group_size, self.tcfg
        if tc.advantage != "anchor":
            prompt_ids = torch.tensor(self.step_indices(step)).repeat_interleave(g)
            scored = self.score(samples, prompts, metadata, prompt_ids, step)
            return scored.advantages, [True] * len(firsts), scored.logs
        groups = [([forks[j]] * g, [metadata[i]] * g) for j, i in enumerate(firsts)]
        anchor_inputs = (forks, [metadata[i] for i in firsts])
        scored = self.score(samples, prompts, metadata, None, step)
        weights = scored.scores.weights.double()
        signals = []  # (signal weight, branch values (N, M), ok (N, M), anchor values (J, M), anchor ok (J, M))
        if tc.global_weight > 0:
            with torch.no_grad():
                whole = torch.cat([self.policy.decode(a.final_latents) for a in anchors])
            branch = self.global_signal(samples, prompts, metadata, step, scored.scores)
            ref = self.global_signal(whole, [prompts[i] for i in firsts], anchor_inputs[1], step)
            signals.append((tc.global_weight, *branch, *ref))
        if tc.local_weight > 0:  # chunk lengths may differ between groups: each group's chunks decoded alone
            parts, refs = [], []
            with torch.no_grad():
                for j, k in enumerate(routed):
                    videos = self.policy.decode(torch.cat(chunks[j * g:(j + 1) * g]))
                    parts.append(self.score(videos, *groups[j], None, step).scores)
                    refs.append(self.score(self.policy.decode(anchors[j].final_latents[:, :, self.local_span(k)]),
                                           [anchor_inputs[0][j]], [anchor_inputs[1][j]], None, step).scores)
            signals.append((tc.local_weight, torch.cat([p.values for p in parts]), torch.cat([p.ok for p in parts]),
                            torch.cat([r.values for r in refs]), torch.cat([r.ok for r in refs])))
        advantages, safe = torch.zeros(len(samples), dtype=torch.float64), []
        for j in range(len(firsts)):
            rows = slice(j * g, (j + 1) * g)
            valid, beat, fused = torch.ones(g, dtype=torch.bool), False, []
            for weight, values, ok, ref, ref_ok in signals:
                totals, reference = (values[rows].double() * weights).sum(1), ref[j].double()
                beat |= bool((totals[ok[rows].all(1)] > (reference * weights).sum()).any())
                valid &= ok[rows].all(1) & bool(ref_ok[j].all())  # an invalid anchor or branch has no advantage
                fused.append((values[rows].double(), reference, weight))
            safe.append(beat)
            if bool(valid.any()):
                adv = fused_anchor_advantages([(v[valid], r, w) for v, r, w in fused], weights, tc.adv_clip)
                advantages[rows.start + valid.nonzero().flatten()] = adv
        logs = {**scored.logs, "kvpo/beat_anchor": sum(safe) / len(safe)}
        if tc.global_weight > 0:
            logs["kvpo/anchor_reward"] = float((signals[0][3].double() * weights).sum(1).mean())
        return advantages, safe, logs

    def local_span(self, chunk: int) -> slice:
        """The latent frames the local signal scores for a branch routed at ``chunk``: the routed chunk, or the
        chunk of ``local_layout`` holding it (:func:`layout_span`)."""
        if self.tcfg.local_layout is None:
            return self.policy.chunk_slice(chunk)
        first, then = self.tcfg.local_layout
        return slice(*layout_span(self.policy.chunk_slice(chunk).start, first, then, sum(self.policy.chunk_frames)))

    def global_signal(self, videos: torch.Tensor, prompts: list[str], metadata: list[dict], step: int,
                      scored: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The global signal's rewards ``(N, M)`` of videos ``(N, F, 3, H, W)`` and whether each is valid: their
        clip of ``global_frames`` centred on the video scored with the prompt (``scored``, the videos' own
        scores, stand in when the clip is the whole video); for streams that switched prompts, a clip centred on
        each segment scored with its segment's prompt, averaged over the segments (their
        ``_compute_rewards_long``)."""
        tc = self.tcfg
        if not self.segments:
            clips = middle_frames(videos, tc.global_frames)
            out = scored if clips is videos and scored is not None else self.score(clips, prompts, metadata, None,
                                                                                   step).scores
            return out.values, out.ok
        values, ok = [], []
        for i, a, b in segment_bounds(videos.shape[1], tc.switch_frames, self.policy.scale_t):
            out = self.score(middle_frames(videos, tc.global_frames, (a, b)),
                             [self.segments.of_prompt(m)[i] for m in metadata], metadata, None, step).scores
            values.append(out.values.double())
            ok.append(out.ok)
        return torch.stack(values).mean(0), torch.stack(ok).all(0)

    def plan(self, batch: BranchBatch, generator: torch.Generator) -> Plan:
        """One optimiser step over every group, a unit each."""
        total = self.total(len(batch.groups))
        return Plan([[GroupUnit(i, total) for i in range(len(batch.groups))]], global_weights=True)

    def loss(self, batch: BranchBatch, unit: GroupUnit) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        tc, group = self.tcfg, batch.groups[unit.index]
        scores = self.scores(group)
        init = None if group.init_scores is None else group.init_scores.to(scores, non_blocking=True)
        old, adv = group.old_scores.to(scores, non_blocking=True), group.advantages.to(scores, non_blocking=True)
        loss, info = branch_objective(scores, old, adv, tc.clip_low, tc.clip_high, tc.kl_coef, init, group.safe)
        return loss / unit.total, {"kvpo_loss": loss.detach(), **info}
