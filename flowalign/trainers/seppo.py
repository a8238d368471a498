"""SePPO (*SePPO: Semi-Policy Preference Optimization for Diffusion Alignment*, arXiv 2410.05255), in its
flow-matching form (``docs/methods/seppo.md``).

No reward model and no human pairs: only "winning" images x0ʷ (image-caption pairs on disk, or the
rendered scenes of a programmatic benchmark). The "losing" image of each pair is the sample x0ʳ that a
stored *previous checkpoint* (the reference, θ_ref) draws for the same caption. Both are noised at one
shared t with one shared ε and scored by velocity errors ``e(x0) = mean(v(x_t, t | c) − (ε − x0))²`` of
the policy θ and of θ_ref (the paper's Diffusion-DPO ε-errors of SD1.5, in flow-matching form as
``flowalign.trainers.diffusion_dpo``):

    s = sign(e_ref(x0ʷ) − e_θ(x0ʷ))                       (the anchor-based adaptive flipper, AAF)
    Δ = [e_θ(x0ʷ) − e_ref(x0ʷ)] − s·[e_θ(x0ʳ) − e_ref(x0ʳ)],      L = −log σ(−β·Δ/2)

The winning image is the anchor: where the policy already fits it better than the reference does
(s = +1), the policy has moved past the reference, so the reference's sample is likely a loser and is
pushed away (Diffusion-DPO with x0ʳ as the losing image); where the reference fits it better (s = −1),
the reference's sample is likely a winner and both images are learnt towards; where the two fit it
equally (s = 0: the drawn reference is the live weights, as at the first step), only the winning image
is learnt. ``anchor_sign`` picks the paper's ``sign``, its ablation's ``indicator`` 𝟙(e_ref − e_θ > 0)
(s ∈ {1, 0}), or the former form ``tie_negative`` (s = +1 if e_θ < e_ref, else −1; ties −1).

The references are checkpoints of the trainable weights taken every ``reference_every`` steps (the
starting weights first); each step uses one, drawn uniformly among all of them (the paper's
ref ~ U(0, k−1), ``reference_selection: random``, which widens the policy space the samples explore) or
the newest (``latest``); ``max_references`` caps how many are kept (the oldest dropped first; None keeps
every one, as the paper).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.nn.functional as F
from pydantic import Field, model_validator

from flowalign.limits import MAX_CACHE, MAX_COEFFICIENT, MAX_TRAIN_STEPS, MAX_WEIGHT_COPIES
from flowalign.trainers.base import derived_seed
from flowalign.trainers.copies import WeightCopy
from flowalign.trainers.options import InnerEpochOptions, SampleOptions, TrainerConfig
from flowalign.trainers.diffusion_dpo import DiffusionDPOTrainer, PairBatch, PairUnit
from flowalign.trainers.parts.pair_images import PairImages
from flowalign.trainers.rollouts import roll_out, rollout_batches, sample_slots
from flowalign.weight_swap import swapped_in


class SePPOConfig(TrainerConfig, SampleOptions, InnerEpochOptions):
    """SePPO's own rollouts (``SampleOptions``: winning images per step, pairs per forward and reference samples
    per rollout batch, the reference samples' ODE steps and guidance; one reference sample per winning image:
    no groups, no rewards, no advantages); ``inner_epochs`` passes over the batch's pairs."""

    name: Literal["seppo"] = "seppo"
    #: β of the DPO-style loss (large: the per-pair error differences are ~1e-3; as diffusion_dpo)
    dpo_beta: float = Field(2000.0, gt=0, le=MAX_COEFFICIENT)
    #: the winning images: a folder of images with .txt captions or a JSONL of {"image", "prompt"}; None:
    #: the rendered scenes of data.bench (a rendered scene satisfies its prompt by construction)
    pairs: str | None = None
    #: t of each pair: "logit_normal" (σ(n), n ~ N(0, 1)) or "uniform" on (0, 1)
    timestep_sampling: Literal["logit_normal", "uniform"] = "logit_normal"
    #: a reference checkpoint of the trainable weights is stored every this many steps
    reference_every: int = Field(10, ge=1, le=MAX_TRAIN_STEPS)
    #: stored reference checkpoints kept in memory, the oldest dropped first once there are more; None: every
    #: one (the paper's draw among all previous checkpoints, the starting weights included; 8 was the default
    #: before, which a run past 8 checkpoints draws only among the newest 8)
    max_references: int | None = Field(None, ge=1, le=MAX_WEIGHT_COPIES)
    #: which stored checkpoint is a step's reference: drawn uniformly ("random") or the newest ("latest")
    reference_selection: Literal["random", "latest"] = "random"
    #: false: every reference sample is a negative (s = +1 always; Diffusion-DPO against the reference's samples,
    #: the paper's "w/o AAF" ablation)
    anchor: bool = True
    #: the anchor's sign s from d = e_ref(x0ʷ) − e_θ(x0ʷ): "sign", the paper's sign(d) ∈ {+1, 0, −1} (a tie,
    #: the reference being the live weights, learns the winning image only); "indicator", its ablation's
    #: 𝟙(d > 0) ∈ {1, 0} (a reference sample is pushed away or ignored); "tie_negative", the former form,
    #: +1 if d > 0 else −1 (a tie learns towards the reference's sample)
    anchor_sign: Literal["sign", "indicator", "tie_negative"] = "sign"
    #: winning-image latents kept in memory (each encoded once per run)
    latent_cache: int = Field(50000, ge=1, le=MAX_CACHE)

    #: what runs saved before these options existed computed (see TrainerConfig.before); the anchor's sign only
    #: matters with the anchor on
    before = {"anchor_sign": "tie_negative"}
    before_when = {"anchor_sign": ("anchor", (True,))}

    @model_validator(mode="after")
    def _stored_references_fit(self) -> "SePPOConfig":
        if stored_references(self) > MAX_WEIGHT_COPIES:
            raise ValueError(f"trainer.max_references: null keeps all 1 + max_steps // reference_every = "
                             f"{stored_references(self)} checkpoints, more than {MAX_WEIGHT_COPIES}; set "
                             "trainer.max_references or a larger trainer.reference_every")
        return self


def stored_references(tcfg: SePPOConfig) -> int:
    """The most checkpoints a run of ``max_steps`` holds at once: the starting weights and one every
    ``reference_every`` steps, at most ``max_references``."""
    every = 1 + tcfg.max_steps // tcfg.reference_every
    return every if tcfg.max_references is None else min(tcfg.max_references, every)


# ---------------------------------------------------------------------------------------------- the loss


def anchor_signs(err_w: torch.Tensor, ref_w: torch.Tensor, form: str = "sign") -> torch.Tensor:
    """Per-pair sign ``(P,)`` from ``d = e_ref(x0ʷ) − e_θ(x0ʷ)`` (detached): ``"sign"`` sign(d) (+1: the policy
    fits the winning image better, the reference sample is a negative; −1: the reference fits it better, the
    sample is learnt towards; 0 at a tie, the sample left out); ``"indicator"`` 𝟙(d > 0); ``"tie_negative"``
    +1 if d > 0 else −1 (the former form)."""
    d = ref_w.detach() - err_w.detach()
    if form == "sign":
        return torch.sign(d).to(err_w.dtype)
    if form == "indicator":
        return (d > 0).to(err_w.dtype)
    if form == "tie_negative":
        return torch.where(d > 0, 1.0, -1.0).to(err_w.dtype)
    raise ValueError(f"anchor_signs: unknown form {form!r} (sign, indicator or tie_negative)")


def seppo_loss(err_w: torch.Tensor, err_r: torch.Tensor, ref_w: torch.Tensor, ref_r: torch.Tensor, beta: float,
               anchor: bool = True, form: str = "sign") -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-pair ``−log σ(−β/2·[(e_θʷ − e_refʷ) − s·(e_θʳ − e_refʳ)])`` ``(P,)``.

    ``err_*`` / ``ref_*`` ``(P,)``: velocity errors of the policy / the reference checkpoint on the winning
    image (w) and on the reference's own sample (r); ``s = anchor_signs(err_w, ref_w, form)`` (all +1 without
    ``anchor``: then this is the Diffusion-DPO loss with x0ʳ as the losing image). References detached.
    ``flip_frac`` is the share of pairs with s = −1 (the paper's AAF rate), ``tie_frac`` with s = 0.
    """
    signs = anchor_signs(err_w, ref_w, form) if anchor else torch.ones_like(err_w)
    delta = (err_w - ref_w.detach()) - signs * (err_r - ref_r.detach())
    inside = -0.5 * beta * delta
    loss = -F.logsigmoid(inside)
    return loss, {"seppo_loss": loss.detach().mean(), "negative_frac": (signs > 0).float().mean(),
                  "flip_frac": (signs < 0).float().mean(), "tie_frac": (signs == 0).float().mean(),
                  "margin": inside.detach().mean()}


def pick_reference(steps: list[int], how: str, generator: torch.Generator) -> int:
    """Index into the stored checkpoints (taken at ``steps``, oldest first): the newest, or uniform."""
    if how == "latest" or len(steps) == 1:
        return len(steps) - 1
    return int(torch.randint(len(steps), (1,), generator=generator))


# ---------------------------------------------------------------------------------------------- hooks


@dataclass
class SePPOBatch(PairBatch):
    """Diffusion-DPO's pair batch with ``x_l`` the reference's samples and the reference weights used."""

    reference: list[torch.Tensor] = field(default_factory=list)


class SePPOTrainer(DiffusionDPOTrainer):
    Config = SePPOConfig
    tcfg: SePPOConfig
    needs_rewards = False

    @classmethod
    def check_config(cls, cfg, tcfg) -> None:
        pass  # no reward: the winning images and the reference's own samples make the pairs

    @classmethod
    def weight_copies(cls, cfg, tcfg) -> list[WeightCopy]:
        """The stored reference checkpoints, copies of the trained tensors (not the adapter switched off): the
        starting weights and one every ``reference_every`` steps, at most ``max_references``
        (:func:`stored_references`)."""
        return [WeightCopy("snapshot", count=stored_references(tcfg))]

    def __init__(self, *args: Any, **kw: Any):
        super().__init__(*args, **kw)
        tc = self.tcfg
        self.images = PairImages(self.policy, self.cfg, self.data, tc.pairs, tc.name, tc.latent_cache)
        #: stored reference checkpoints (copies of the trainable weights) and the steps they were taken at
        self.references: list[list[torch.Tensor]] = [[p.detach().clone() for p in self.params]]
        self.reference_steps: list[int] = [0]
        self.images.latents(self.step_pairs(0)[:1])  # one winning image end to end: bad data fails first

    def offline_pair_set(self) -> None:
        return None  # trainer.pairs holds winning images with captions, not preference triples

    def step_pairs(self, step: int) -> list[int]:
        """This rank's winning images of a step (``prompts_per_step`` of them), as indices into the pairs."""
        return self.step_indices(step, self.images.pairs, self.tcfg.prompts_per_step)

    def collect(self, step: int) -> SePPOBatch:
        """This rank's winning images, the step's reference checkpoint, and that checkpoint's own ODE sample
        for each caption (the losing side)."""
        tc, p = self.tcfg, self.tcfg.prompts_per_step
        indices = self.step_pairs(step)
        prompts = [self.images.pairs.prompts[i] for i in indices]
        metadata = [self.images.pairs.metadata[i] for i in indices]
        pick = pick_reference(self.reference_steps, tc.reference_selection,
                              torch.Generator().manual_seed(derived_seed(self.cfg.run.seed, step, 61)))
        reference = self.references[pick]
        x_r = self.reference_samples(reference, prompts, metadata, step)
        x_w = self.images.latents(indices).to(x_r)
        seeds = [derived_seed(self.cfg.run.seed, step, self.rank * p + n, 47) for n in range(len(indices))]
        logs = {"train/pairs": float(len(indices)), "reference/step": float(self.reference_steps[pick]),
                "reference/age": float(step - self.reference_steps[pick]),
                "reference/stored": float(len(self.references))}
        return SePPOBatch(x_w, x_r, self.policy.encode(prompts), seeds, logs, reference=reference)

    @torch.no_grad()
    def reference_samples(self, reference: list[torch.Tensor], prompts: list[str], metadata: list[dict],
                          step: int) -> torch.Tensor:
        """``(P, ...)`` final latents the reference checkpoint samples for ``prompts`` (ODE, the run's steps
        and guidance), each from a generator keyed by its place in the step's global draw."""
        p = self.tcfg.prompts_per_step
        groups = torch.arange(self.rank * p, self.rank * p + len(prompts))
        slots = sample_slots(self.policy, prompts, metadata, groups, groups, self.cfg.run.seed, step, False)
        sampling = {int(g): self.sampling(int(g)) for g in groups}
        with swapped_in(self.params, reference):
            chunks = [roll_out(self.policy, b, sampling[b[0].group], self.tcfg.num_steps, self.tcfg.guidance_scale)
                      for b in rollout_batches(slots, sampling, self.tcfg.batch_size)]
        return torch.cat([c.final_latents for c in chunks]).float()

    def reference_errors(self, batch: SePPOBatch, index: tuple[int, ...], t: torch.Tensor,
                         eps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``e_ref(x0ʷ), e_ref(x0ʳ)`` under the step's reference checkpoint."""
        with torch.no_grad(), swapped_in(self.params, batch.reference):
            return self.errors(batch, index, t, eps)

    def loss(self, batch: SePPOBatch, unit: PairUnit) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        err_w, err_r = self.errors(batch, unit.index, unit.t, unit.eps)
        per_pair, info = seppo_loss(err_w, err_r, unit.ref_w.to(err_w), unit.ref_l.to(err_r), self.tcfg.dpo_beta,
                                    self.tcfg.anchor, self.tcfg.anchor_sign)
        return per_pair.sum() / unit.total, info

    def finish(self, batch: SePPOBatch, steps: list[dict[str, list[float]]]) -> dict[str, float]:
        """After the optimiser steps: a new reference checkpoint every ``reference_every`` steps."""
        after = self.step + 1
        if after % self.tcfg.reference_every == 0:
            self.references.append([p.detach().clone() for p in self.params])
            self.reference_steps.append(after)
            if self.tcfg.max_references is not None and len(self.references) > self.tcfg.max_references:
                del self.references[0], self.reference_steps[0]
        return {}

    def state_dict(self) -> dict[str, Any]:
        tensors = {f"reference.{k}.{i}": t for k, ref in enumerate(self.references) for i, t in enumerate(ref)}
        return {**tensors, "reference_steps": list(self.reference_steps)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.reference_steps = [int(s) for s in state["reference_steps"]]
        self.references = [[self.parallel.place(state[f"reference.{k}.{i}"], p).clone() for i, p in enumerate(self.params)]
                           for k in range(len(self.reference_steps))]
